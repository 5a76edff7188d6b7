"""vllm/v1/kv_cache_interface.py at jsboige/vllm 6adad087 (2026-08-14): KVCacheConfig and its
parts, and the KV cache specs a connector reads (fields and page_size_bytes as upstream; the
specs' other methods, used by vLLM's allocator, are left out)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: Optional[int] = None

    @property
    def real_page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * \
            torch.tensor([], dtype=self.dtype).element_size()

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            assert self.page_size_padded >= self.real_page_size_bytes
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: Optional[int] = None
    sliding_window: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: Optional[str] = None

    @property
    def real_page_size_bytes(self) -> int:  # one latent per token, no K/V pair
        return self.block_size * self.num_kv_heads * self.head_size * \
            torch.tensor([], dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    head_size_v: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[torch.dtype, ...]
    page_size_padded: Optional[int] = None
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    @property
    def page_size_bytes(self) -> int:
        size = sum(math.prod(s) * torch.tensor([], dtype=d).element_size()
                   for s, d in zip(self.shapes, self.dtypes))
        if self.page_size_padded is not None:
            assert self.page_size_padded >= size
            return self.page_size_padded
        return size


@dataclasses.dataclass
class KVCacheTensor:
    size: int  # bytes
    shared_by: List[str]
    offset: int = 0  # byte offset of this layer within a contiguous block
    block_stride: int = 0  # total bytes per block in a packed layout (0 = not packed)


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: List[str]
    kv_cache_spec: Any
    is_eagle_group: bool = False


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: List[KVCacheTensor]
    kv_cache_groups: List[KVCacheGroupSpec]
