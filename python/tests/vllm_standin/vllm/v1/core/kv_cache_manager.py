"""vllm/v1/core/kv_cache_manager.py at jsboige/vllm 6adad087 (2026-08-14): KVCacheBlocks, what
the scheduler hands update_state_after_alloc (kv_cache_manager.get_blocks(request_id)); one
sequence of blocks per KV cache group."""

from __future__ import annotations

import dataclasses
import itertools
from typing import List, Sequence, Tuple

from vllm.v1.core.kv_cache_utils import KVCacheBlock


@dataclasses.dataclass
class KVCacheBlocks:
    blocks: Tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(list(itertools.chain(a, b))
                                   for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False):  # type: ignore[no-untyped-def]
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> List[int]:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> List[List[int]]:
        return [[block.block_id for block in group
                 if block.block_hash is None and not block.is_null]
                for group in self.blocks]

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))
