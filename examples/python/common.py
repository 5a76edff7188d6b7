"""What the example prefill and decode processes share: the model shape, the requests (as a
router would send them to both sides), and the bytes every KV page must hold.

KV pools are torch tensors shaped like SGLang's MHA pool, one per layer and K/V:
[num_pages, page_size, heads_on_this_rank, head_dim] fp16 (token-major, pdlib's KVLayout.NHD).
"""

from __future__ import annotations

import dataclasses
import random
from typing import List, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Model:
    layers: int = 4
    heads: int = 8  # KV heads of the whole model
    head_dim: int = 64
    page_size: int = 16
    pool_pages: int = 256


def requests(seed: int, count: int, max_tokens: int) -> List[Tuple[int, int]]:
    """(bootstrap_room, prompt tokens) of every request, the same list on both sides."""
    rng = random.Random(seed)
    return [(1000 + i, rng.randint(1, max_tokens)) for i in range(count)]


def page_content(room: int, buffer: int, page_pos: int, model: Model) -> torch.Tensor:
    """The whole model's page (all heads) of one buffer, as int16 bits of the fp16 values."""
    g = torch.Generator().manual_seed((room * 1000003 + buffer * 1009 + page_pos) & 0x7FFFFFFF)
    return torch.randint(-32768, 32767, (model.page_size, model.heads, model.head_dim),
                         dtype=torch.int16, generator=g)


def head_slice(page: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    per_rank = page.shape[1] // tp_size
    return page[:, tp_rank * per_rank:(tp_rank + 1) * per_rank, :]


def kv_pools(model: Model, tp_size: int) -> List[torch.Tensor]:
    shape = (model.pool_pages, model.page_size, model.heads // tp_size, model.head_dim)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(2 * model.layers)]


def first_token(room: int) -> int:
    return (room * 2654435761) % 32000
