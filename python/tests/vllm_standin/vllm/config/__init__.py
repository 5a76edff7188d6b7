"""vllm.config: the fields of VllmConfig and its parts that pdlib.vllm reads (upstream
vllm/config/*.py; ModelConfig.get_total_num_kv_heads() and use_mla are upstream's names)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from vllm.config.kv_transfer import KVTransferConfig

__all__ = ["CacheConfig", "KVTransferConfig", "ModelConfig", "ParallelConfig", "VllmConfig"]


@dataclasses.dataclass
class ModelConfig:
    model: str = "facebook/opt-125m"
    # Upstream derives these from the HF config; the stand-in takes them as given.
    total_num_kv_heads: int = 1
    head_size: int = 64
    use_mla: bool = False

    def get_total_num_kv_heads(self) -> int:
        return self.total_num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


@dataclasses.dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    num_gpu_blocks: Optional[int] = None
    mamba_cache_mode: str = "none"


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_rank: int = 0


@dataclasses.dataclass
class VllmConfig:
    model_config: Optional[ModelConfig] = None
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    kv_transfer_config: Optional[KVTransferConfig] = None
