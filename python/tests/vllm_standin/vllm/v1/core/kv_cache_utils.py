"""vllm/v1/core/kv_cache_utils.py: KVCacheBlock (the fields KVCacheBlocks reads)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[Any] = None
    is_null: bool = False
