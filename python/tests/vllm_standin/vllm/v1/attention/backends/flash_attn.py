"""vllm/v1/attention/backends/flash_attn.py at jsboige/vllm 6adad087 (2026-08-14):
FlashAttentionBackend's KV cache shape and stride order, as upstream PR #44455 (51878e5b6,
2026-07-11) made them: K and V packed into the content dim, logical (B, H, N, 2*D). (FlashInfer,
Triton, FlexAttention and the CPU backend use the same shape at that commit.)"""

from __future__ import annotations

from typing import Tuple

from vllm.v1.attention.backends.utils import get_kv_cache_layout


class FlashAttentionBackend:
    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> Tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError("Block size must be a multiple of 16.")
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                  ) -> Tuple[int, ...]:
        cache_layout = get_kv_cache_layout()
        if cache_layout == "NHD" and include_num_layers_dimension:
            return (1, 0, 3, 2, 4)
        elif cache_layout == "NHD":
            return (0, 2, 1, 3)
        elif cache_layout == "HND" and include_num_layers_dimension:
            return (1, 2, 0, 3, 4)
        elif cache_layout == "HND":
            return (0, 1, 2, 3)
        raise ValueError(f"Unknown cache layout format {cache_layout}.")
