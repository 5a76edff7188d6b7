"""The byte pattern and request shapes shared by the two-process tests (tests and peer.py).

Prefill fills every page it sends with bytes derived from (seed, room, buffer, page position in
the request); decode checks every byte against the same function. Pages are placed differently
on each side, so a write to the wrong page, buffer, offset or room fails the check. With TP,
the pattern is that of the whole model's page ([head][token][dim], HND) and a rank holds the
contiguous slice of its heads; MLA pages are whole on every rank.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Dict, List

import numpy as np

STATE_BUFFER_BASE = 1 << 20  # state buffer s uses pattern "buffer" STATE_BUFFER_BASE + s


def full_page(seed: int, room: int, buffer: int, page_pos: int, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng([seed, room, buffer, page_pos])
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def rank_slice(page: np.ndarray, tp_size: int, tp_rank: int, mla: bool) -> np.ndarray:
    if mla or tp_size == 1:
        return page
    part = page.size // tp_size
    return page[tp_rank * part:(tp_rank + 1) * part]


def aux_token(room: int) -> int:
    return (room * 2654435761) % 32000


@dataclasses.dataclass
class Layout:
    """The model and pool shape both sides agree on (from the test's config)."""

    layers: int = 2
    heads: int = 4
    head_bytes: int = 32  # head_dim * dtype bytes
    page_size: int = 4
    pool_pages: int = 64
    mla: bool = False
    state_buffers: int = 0
    state_slots: int = 8
    state_item_bytes: int = 64

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Layout":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @property
    def kv_buffers(self) -> int:
        return self.layers if self.mla else 2 * self.layers

    def page_bytes(self, tp_size: int) -> int:
        """Bytes of one page of one buffer on a rank of a side with `tp_size` ranks."""
        full = (1 if self.mla else self.heads) * self.page_size * self.head_bytes
        return full if self.mla else full // tp_size


@dataclasses.dataclass
class Shape:
    pages: int
    chunks: int

    def chunk_sizes(self) -> List[int]:
        base = self.pages // self.chunks
        return [base] * (self.chunks - 1) + [self.pages - base * (self.chunks - 1)]


def shape_of(seed: int, room: int, max_pages: int, max_chunks: int) -> Shape:
    rng = random.Random(seed * 1000003 + room)
    pages = rng.randint(1, max_pages)
    return Shape(pages, rng.randint(1, min(max_chunks, pages)))


def pick_pages(rng: random.Random, free: List[int], count: int) -> List[int]:
    """`count` pages taken at random from `free` (scattered, as an engine's allocator would)."""
    picked = rng.sample(free, count)
    for p in picked:
        free.remove(p)
    return picked
