"""vLLM's KV cache tensors as pdlib buffers, derived from each tensor's shape and strides.

Pure functions (no torch, no vLLM): pdlib.vllm hands in what it read off the tensors
register_kv_caches received and off the KV cache spec of their group, and gets back the buffers
to register, the page layout and how vLLM's block ids map to pdlib's pages. Unit tested on every
layout vLLM allocated since 2026-01 (python/tests/test_vllm_layout.py).

What vLLM hands register_kv_caches, read at jsboige/vllm 6adad087 (upstream main of 2026-08-14):
the model runner (v1/worker/gpu_model_runner.py _reshape_kv_cache_tensors, gpu/attn_utils.py
_reshape_attention_kv_cache) allocates one raw int8 buffer per KVCacheTensor, views it in the
attention backend's stride order and passes `view(permuted shape).permute(inverse order)`: a
tensor in the backend's *logical* shape whose strides say where things are. The logical shapes:

  * packed K/V (FlashAttention, FlashInfer, Triton, FlexAttention, CPU since upstream PR #44455,
    51878e5b6 of 2026-07-11): (num_blocks, num_kv_heads, block_size, 2 * head_size), K then V
    in each row; stride order HND (0, 1, 2, 3) or NHD (0, 2, 1, 3);
  * the older K/V-first layout (FlashAttention before July, ROCm still):
    (2, num_blocks, block_size, num_kv_heads, head_size), HND or NHD inside a block; with a
    Mamba group sharing the memory vLLM re-strides it blocks-first (as_strided: K and V of a
    block next to each other);
  * the older FlashInfer layout (num_blocks, 2, block_size, num_kv_heads, head_size);
  * MLA: (num_blocks, block_size, latent).
num_blocks may count kernel blocks (a kernel block size dividing vLLM's --block-size), block
strides may exceed a block (page_size_padded), and KVCacheTensor.block_stride packs every layer
of a block next to each other in one backing buffer (a layer's view then starts at its offset).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["TensorInfo", "Geometry", "LayerLayout", "KVLayoutDescription", "describe_layer",
           "describe_layers", "describe_state_pages", "expand_blocks", "LayoutError"]


class LayoutError(ValueError):
    """A tensor pdlib cannot move as it is; the message names the shape, the strides and what
    pdlib would need."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One registered tensor as pdlib reads it: its layer, address, logical shape, strides (in
    elements), element size and dtype name ("float16", "uint8", ...)."""

    name: str
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    element_size: int
    dtype: str = ""

    @classmethod
    def of(cls, name: str, tensor: Any) -> "TensorInfo":  # a torch.Tensor
        return cls(name, int(tensor.data_ptr()), tuple(int(d) for d in tensor.shape),
                   tuple(int(s) for s in tensor.stride()), int(tensor.element_size()),
                   str(tensor.dtype).replace("torch.", ""))

    def where(self) -> str:
        return (f"KV cache tensor {self.name!r} of shape {self.shape} (strides {self.strides}, "
                f"{self.dtype or f'{self.element_size}-byte elements'})")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What vLLM's KV cache spec of the layer's group says (AttentionSpec: block_size,
    num_kv_heads of this rank, head_size; MLAAttentionSpec: MLA) and the config's num_blocks."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    mla: bool = False


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Where one layer's blocks, heads, tokens and K/V are in memory.

    kind: "packed" (K and V in each row), "kv_split" (a K region and a V region), "kv_block"
    (each block holds its K page then its V page) or "mla". order: "HND" or "NHD" inside a page
    ("" for MLA). regions: (address, bytes, item bytes) to register: K then V for kv_split, one
    otherwise; item = one kernel block (padding included). page_bytes: the bytes of one kernel
    block without padding. blocks_per_block: kernel blocks per vLLM block. sliceable: a head
    range of a page is what pdlib's HND/NHD slicing takes (heterogeneous TP)."""

    kind: str
    order: str
    regions: Tuple[Tuple[int, int, int], ...]
    page_bytes: int
    item_bytes: int
    kernel_blocks: int
    blocks_per_block: int
    kernel_block_size: int
    heads: int
    row_elements: int  # elements of one (head, token) row: 2 * head_size packed, the latent MLA
    sliceable: bool


def _dense_box(t: TensorInfo, dims: Sequence[int]) -> Optional[int]:
    """Elements of the box `dims` span when they tile it exactly with the innermost at stride 1
    (dimensions of extent 1 do not count); None when they do not."""
    expected = 1
    for d in sorted((d for d in dims if t.shape[d] != 1), key=lambda d: t.strides[d]):
        if t.strides[d] != expected:
            return None
        expected *= t.shape[d]
    return expected


def describe_layer(t: TensorInfo, g: Geometry) -> LayerLayout:
    """One layer's tensor against its group's geometry. Raises LayoutError for anything pdlib
    cannot move as it is."""
    where = t.where()
    nd = len(t.shape)
    if nd != len(t.strides) or nd == 0 or any(d <= 0 for d in t.shape):
        raise LayoutError(f"pdlib.vllm: {where}: not a KV cache")
    if any(s <= 0 for d, s in zip(t.shape, t.strides) if d > 1):
        raise LayoutError(f"pdlib.vllm: {where}: a zero or negative stride (a broadcast or "
                          "flipped view) cannot be registered")
    kv_dim: Optional[int] = None
    if g.mla:
        if nd != 3:
            raise LayoutError(f"pdlib.vllm: MLA {where}: expected (num_blocks, block_size, "
                              "latent)")
        b, h, n, c = 0, None, 1, 2
        kind = "mla"
    elif nd == 4:  # packed: (B, H, N, 2D)
        b, h, n, c = 0, 1, 2, 3
        kind = "packed"
        if t.shape[1] != g.num_kv_heads or t.shape[3] % 2:
            raise LayoutError(
                f"pdlib.vllm: {where}: read as the packed layout (num_blocks, num_kv_heads, "
                f"block_size, 2 * head_size) it holds {t.shape[1]} heads of {t.shape[3]} "
                f"elements; the KV cache spec says {g.num_kv_heads} heads of head_size "
                f"{g.head_size} on this rank")
    elif nd == 5:
        if t.shape[0] == 2 and t.shape[1] == 2:
            raise LayoutError(f"pdlib.vllm: {where}: with 2 blocks, the K/V dimension and the "
                              "block dimension cannot be told apart")
        if t.shape[0] == 2:
            kv_dim, b = 0, 1  # (2, B, N, H, D)
        elif t.shape[1] == 2:
            kv_dim, b = 1, 0  # (B, 2, N, H, D)
        else:
            raise LayoutError(
                f"pdlib.vllm: {where}: a 5-D KV cache must be (2, num_blocks, block_size, "
                "num_kv_heads, head_size) or (num_blocks, 2, block_size, num_kv_heads, "
                "head_size)")
        n, h, c = 2, 3, 4
        kind = "kv_split"
        if t.shape[3] != g.num_kv_heads or t.shape[4] != g.head_size:
            raise LayoutError(
                f"pdlib.vllm: {where}: holds {t.shape[3]} heads of {t.shape[4]} elements; the "
                f"KV cache spec says {g.num_kv_heads} heads of head_size {g.head_size} on this "
                "rank")
    else:
        raise LayoutError(
            f"pdlib.vllm: {where}: pdlib reads the packed layout (num_blocks, num_kv_heads, "
            "block_size, 2 * head_size), the K/V-first (2, num_blocks, block_size, heads, "
            "head_size), FlashInfer's (num_blocks, 2, block_size, heads, head_size) and MLA "
            "(num_blocks, block_size, latent)")
    blocks, tokens = t.shape[b], t.shape[n]
    if blocks % g.num_blocks or tokens * (blocks // g.num_blocks) != g.block_size:
        raise LayoutError(
            f"pdlib.vllm: {where}: {blocks} blocks of {tokens} tokens do not divide vLLM's "
            f"{g.num_blocks} blocks of {g.block_size} tokens into whole kernel blocks")
    k = blocks // g.num_blocks
    inner = [d for d in (h, n, c) if d is not None]
    page = _dense_box(t, inner)
    if page is None or t.strides[c] != 1:
        what = "tokens and latent" if g.mla else "heads, tokens and elements"
        raise LayoutError(
            f"pdlib.vllm: {where}: a block's {what} are not one dense piece with contiguous "
            "elements; pdlib needs each block (or each of its K and V halves) to be one "
            "contiguous page")
    order = ""
    if h is not None:
        order = "HND" if t.shape[h] == 1 or t.strides[h] > t.strides[n] else "NHD"
    es = t.element_size
    sb = t.strides[b]
    if kv_dim is None:
        if blocks > 1 and sb < page:
            raise LayoutError(f"pdlib.vllm: {where}: blocks overlap (block stride {sb} < a "
                              f"block's {page} elements)")
        item = sb * es if blocks > 1 else page * es
        regions: Tuple[Tuple[int, int, int], ...] = ((t.ptr, blocks * item, item),)
    else:
        skv = t.strides[kv_dim]
        if blocks == 1:
            sb = page  # one block: its stride says nothing
        if skv >= blocks * sb and sb >= page:  # a K region, then a V region
            item = sb * es
            regions = ((t.ptr, blocks * item, item), (t.ptr + skv * es, blocks * item, item))
        elif skv >= page and sb >= skv + page:  # each block: its K page, then its V page
            kind = "kv_block"
            item = sb * es
            regions = ((t.ptr, blocks * item, item),)
        else:
            raise LayoutError(
                f"pdlib.vllm: {where}: K and V (stride {skv}) and the blocks (stride {sb}) "
                f"interleave below a page of {page} elements")
    padded = item != (2 * page * es if kind == "kv_block" else page * es)
    return LayerLayout(kind=kind, order=order, regions=regions,
                       page_bytes=(2 if kind == "kv_block" else 1) * page * es,
                       item_bytes=item, kernel_blocks=blocks, blocks_per_block=k,
                       kernel_block_size=tokens, heads=0 if h is None else t.shape[h],
                       row_elements=t.shape[c], sliceable=kind in ("packed", "kv_split") and
                       not padded)


@dataclasses.dataclass
class KVLayoutDescription:
    """The layers of one KV cache group as pdlib buffers. buffers: (address, bytes, item
    bytes), K of every layer then V of every layer for kv_split, one per layer (or one for all
    layers packed into one backing buffer) otherwise. num_layers: distinct layers (tensors
    shared by several layer names count once). page_layout: what both sides must agree on,
    for the fingerprint."""

    layer: LayerLayout
    buffers: List[Tuple[int, int, int]]
    num_layers: int
    layer_names: List[str]
    cross_layer: bool  # every layer in one backing buffer, a block = every layer's page
    dtype: str
    element_size: int

    @property
    def sliceable(self) -> bool:
        return self.layer.sliceable and not self.cross_layer

    @property
    def page_layout(self) -> str:
        lay = self.layer
        text = f"vllm-{lay.kind}" + (f"-{lay.order.lower()}" if lay.order else "")
        if self.cross_layer:
            text += f"-cross-layer{self.num_layers}"
        if lay.item_bytes != lay.page_bytes:
            text += f"-padded{lay.item_bytes}"
        return text


def describe_layers(tensors: Sequence[TensorInfo], g: Geometry) -> KVLayoutDescription:
    """Every layer of one group. Layers whose names share one tensor (same address, shape and
    strides) are one layer; all must have one layout; layers packed into one backing buffer
    (every layer's page of a block next to each other) become one buffer whose item is the
    whole block."""
    if not tensors:
        raise LayoutError("pdlib.vllm: no KV cache tensors to register")
    distinct: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...]], TensorInfo] = {}
    for t in tensors:
        distinct.setdefault((t.ptr, t.shape, t.strides), t)
    layers = list(distinct.values())
    described = [describe_layer(t, g) for t in layers]
    first, lay = layers[0], described[0]
    for t, d in zip(layers[1:], described[1:]):
        if t.dtype != first.dtype or t.element_size != first.element_size:
            raise LayoutError(f"pdlib.vllm: {t.where()} and {first.where()}: layers of one KV "
                              "cache group with different dtypes are not supported")
        if dataclasses.replace(d, regions=()) != dataclasses.replace(lay, regions=()):
            raise LayoutError(f"pdlib.vllm: {t.where()} is laid out as {d.kind} {d.order} "
                              f"(item {d.item_bytes} bytes), {first.where()} as {lay.kind} "
                              f"{lay.order} (item {lay.item_bytes}): one layout per group")
    spans = sorted((r[0], r[0] + r[1], i) for i, d in enumerate(described) for r in d.regions)
    overlap = any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
    names = [t.name for t in layers]
    if not overlap:
        if lay.kind == "kv_split":
            buffers = [d.regions[0] for d in described] + [d.regions[1] for d in described]
        else:
            buffers = [d.regions[0] for d in described]
        return KVLayoutDescription(lay, buffers, len(layers), names, False, first.dtype,
                                   first.element_size)
    # Layers packed into one backing buffer (KVCacheTensor.block_stride): each layer's page at
    # its own offset inside every block. They must tile the block without overlapping.
    base = min(r[0] for d in described for r in d.regions)
    offsets = sorted((d.regions[0][0] - base, t) for d, t in zip(described, layers))
    ok = len(lay.regions) == 1 and all(
        a[0] + lay.page_bytes <= b[0] for a, b in zip(offsets, offsets[1:])) and \
        offsets[-1][0] + lay.page_bytes <= lay.item_bytes
    if not ok:
        raise LayoutError(
            f"pdlib.vllm: {offsets[0][1].where()} and {offsets[-1][1].where()} overlap in "
            "memory in a way that is neither one tensor shared by several layers nor every "
            "layer of a block packed next to each other")
    cross = dataclasses.replace(lay, sliceable=False)
    return KVLayoutDescription(cross, [(base, lay.kernel_blocks * lay.item_bytes,
                                        lay.item_bytes)], len(layers), names, True,
                               first.dtype, first.element_size)


def describe_state_pages(tensors: Sequence[TensorInfo], num_blocks: int, page_bytes: int
                         ) -> List[Tuple[int, int, int]]:
    """Mamba (linear attention, GatedDeltaNet) state: vLLM hands one (num_blocks, 1, 1,
    page_size_bytes) int8 view per layer (the layer unpacks its conv and SSM state from each
    block's bytes). One buffer per distinct tensor, item = one block."""
    out: List[Tuple[int, int, int]] = []
    seen = set()
    for t in tensors:
        if (t.ptr, t.shape, t.strides) in seen:
            continue
        seen.add((t.ptr, t.shape, t.strides))
        nbytes = 1
        for d in t.shape[1:]:
            nbytes *= d
        nbytes *= t.element_size
        if len(t.shape) < 2 or t.shape[0] != num_blocks or nbytes < page_bytes or \
                _dense_box(t, range(1, len(t.shape))) is None or \
                (num_blocks > 1 and t.strides[0] * t.element_size < nbytes):
            raise LayoutError(
                f"pdlib.vllm: state {t.where()}: expected {num_blocks} blocks of "
                f"{page_bytes} contiguous bytes each ((num_blocks, 1, 1, page_size_bytes), as "
                "vLLM's model runner views Mamba state)")
        item = t.strides[0] * t.element_size if num_blocks > 1 else nbytes
        out.append((t.ptr, num_blocks * item, item))
    return out


def expand_blocks(block_ids: Sequence[int], blocks_per_block: int) -> List[int]:
    """vLLM's block ids as pdlib pages (kernel blocks): block b is pages [b*k, (b+1)*k)."""
    if blocks_per_block == 1:
        return [int(b) for b in block_ids]
    k = blocks_per_block
    return [int(b) * k + j for b in block_ids for j in range(k)]
