"""vllm/v1/kv_cache_interface.py: KVCacheConfig and its parts (the fields connectors read)."""

from __future__ import annotations

import dataclasses
from typing import Any, List


@dataclasses.dataclass
class KVCacheTensor:
    size: int
    shared_by: List[str]


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: List[str]
    kv_cache_spec: Any


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: List[KVCacheTensor]
    kv_cache_groups: List[KVCacheGroupSpec]
