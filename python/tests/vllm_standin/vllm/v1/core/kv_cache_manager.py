"""vllm/v1/core/kv_cache_manager.py @003df2961dd8: KVCacheBlocks, what the scheduler hands
update_state_after_alloc (kv_cache_manager.get_blocks(request_id))."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from vllm.v1.core.kv_cache_utils import KVCacheBlock


@dataclasses.dataclass
class KVCacheBlocks:
    blocks: Tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> Tuple[List[int], ...]:
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> List[int]:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]
