"""pdlib.vllm's layout derivation (pdlib/_vllm_layout.py) on every KV cache layout vLLM has
allocated since 2026-01, and on the ones it must refuse.

Each tensor is built the way vLLM's model runner builds it at jsboige/vllm 6adad087 (upstream
main of 2026-08-14; v1/worker/gpu/attn_utils.py _reshape_attention_kv_cache,
gpu_model_runner.py _reshape_kv_cache_tensors and _update_hybrid_attention_mamba_layout): a raw
int8 buffer, viewed as the dtype in the backend's stride order, then permuted back to the
logical shape (padded pages through as_strided, layers of a packed backing through a strided
slice). The check is on bytes: a marker written through the tensor's own indexing must be where
the derived description says that block, head, token and K/V element live.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import pytest

torch = pytest.importorskip("torch")

from pdlib._vllm_layout import (Geometry, LayoutError, TensorInfo, describe_layer,  # noqa: E402
                                describe_layers, describe_state_pages, expand_blocks)

NB, BS, H, D = 6, 16, 2, 8


def vllm_view(raw: torch.Tensor, shape: Sequence[int], order: Sequence[int], dtype,
              page_stride_bytes: Optional[int] = None,
              packing: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """_reshape_attention_kv_cache: the permuted shape over the raw bytes, then permute(inv)."""
    permuted = tuple(shape[i] for i in order)
    inv = [list(order).index(i) for i in range(len(order))]
    es = torch.tensor([], dtype=dtype).element_size()
    if packing is not None:
        offset, block_stride = packing
        page_bytes = math.prod(shape[1:]) * es
        t = raw.view(-1, block_stride)[:, offset:offset + page_bytes].view(dtype).view(permuted)
    elif page_stride_bytes is not None:
        strides = list(torch.empty(permuted, device="meta").stride())
        strides[inv[0]] = page_stride_bytes // es
        t = torch.as_strided(raw.view(dtype), size=permuted, stride=tuple(strides))
    else:
        t = raw.view(dtype).view(permuted)
    return t.permute(*inv)


def raw_bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int8)


def info(name: str, t: torch.Tensor) -> TensorInfo:
    return TensorInfo.of(name, t)


def locate(lay, b: int, h: int, n: int, kv: int, e: int, es: int, head_size: int) -> int:
    """Where the description puts element e of (kernel block b, head h, token n, K or V)."""
    region = lay.regions[kv if lay.kind == "kv_split" else 0]
    at = region[0] + b * lay.item_bytes
    if lay.kind == "kv_block":
        at += kv * lay.page_bytes // 2
    row = lay.row_elements
    tokens = lay.kernel_block_size
    if lay.kind == "mla":
        return at + (n * row + e) * es
    first = (h * tokens + n) if lay.order == "HND" else (n * lay.heads + h)
    inner = kv * head_size + e if lay.kind == "packed" else e
    return at + (first * row + inner) * es


def check_marks(raw: torch.Tensor, t: torch.Tensor, lay, write, head_size: int = D) -> None:
    """Writes a distinct marker through the tensor's indexing at several (block, head, token,
    kv, element) and finds each where `locate` says."""
    es = t.element_size()
    base = raw.data_ptr()
    picks = [(0, 0, 0, 0, 0), (lay.kernel_blocks - 1, lay.heads - 1 if lay.heads else 0,
                                lay.kernel_block_size - 1, 1, head_size - 1),
             (1, 0, 3, 1, 2), (2, lay.heads - 1 if lay.heads else 0, 5, 0, 7)]
    for i, (b, h, n, kv, e) in enumerate(picks):
        if lay.kind == "mla":
            kv = 0
        write(t, b, h, n, kv, e, 17 + i)
        at = locate(lay, b, h, n, kv, e, es, head_size) - base
        got = raw[at:at + es].view(t.dtype)[0].item()
        assert got == 17 + i, (lay, (b, h, n, kv, e))


def packed_write(t, b, h, n, kv, e, v):
    t[b, h, n, kv * D + e] = v


def split_write(t, b, h, n, kv, e, v):
    t[kv, b, n, h, e] = v


def fi_write(t, b, h, n, kv, e, v):
    t[b, kv, n, h, e] = v


def mla_write(t, b, h, n, kv, e, v):
    t[b, n, e] = v


GEO = Geometry(NB, BS, H, D)
PAGE = H * BS * D * 2  # elements of one packed block


@pytest.mark.parametrize("order, name", [((0, 1, 2, 3), "HND"), ((0, 2, 1, 3), "NHD")])
def test_packed_layout_hnd_and_nhd(order, name):
    raw = raw_bytes(NB * PAGE * 2)
    t = vllm_view(raw, (NB, H, BS, 2 * D), order, torch.float16)
    lay = describe_layer(info("l0", t), GEO)
    assert (lay.kind, lay.order, lay.sliceable, lay.blocks_per_block) == \
        ("packed", name, True, 1)
    assert lay.regions == ((raw.data_ptr(), NB * PAGE * 2, PAGE * 2),)
    check_marks(raw, t, lay, packed_write)


@pytest.mark.parametrize("order, name", [((0, 1, 3, 2, 4), "HND"), ((0, 1, 2, 3, 4), "NHD")])
def test_kv_first_five_d_layout(order, name):
    page = H * BS * D
    raw = raw_bytes(2 * NB * page * 2)
    t = vllm_view(raw, (2, NB, BS, H, D), order, torch.bfloat16)
    lay = describe_layer(info("l0", t), GEO)
    assert (lay.kind, lay.order, lay.sliceable) == ("kv_split", name, True)
    assert lay.regions == ((raw.data_ptr(), NB * page * 2, page * 2),
                           (raw.data_ptr() + NB * page * 2, NB * page * 2, page * 2))
    check_marks(raw, t, lay, split_write)


def test_kv_first_restrided_blocks_first_beside_mamba():
    # _update_hybrid_attention_mamba_layout: (2, num_blocks, ...) re-strided so that each block
    # holds its K page then its V page (Mamba addresses the same memory by page).
    page = H * BS * D
    raw = raw_bytes(2 * NB * page * 2)
    t = vllm_view(raw, (2, NB, BS, H, D), (0, 1, 2, 3, 4), torch.float16)
    hidden = t.shape[2:].numel()
    t.as_strided_(size=t.shape, stride=(hidden, 2 * hidden, *t.stride()[2:]))
    lay = describe_layer(info("l0", t), GEO)
    assert (lay.kind, lay.order, lay.sliceable) == ("kv_block", "NHD", False)
    assert lay.regions == ((raw.data_ptr(), NB * 2 * page * 2, 2 * page * 2),)
    check_marks(raw, t, lay, split_write)


def test_flashinfer_before_july():
    page = H * BS * D
    raw = raw_bytes(2 * NB * page * 2)
    t = vllm_view(raw, (NB, 2, BS, H, D), (0, 1, 3, 2, 4), torch.float16)
    lay = describe_layer(info("l0", t), GEO)
    assert (lay.kind, lay.order, lay.sliceable) == ("kv_block", "HND", False)
    check_marks(raw, t, lay, fi_write)


def test_mla_and_fp8():
    latent = 576
    raw = raw_bytes(NB * BS * latent)
    t = vllm_view(raw, (NB, BS, latent), (0, 1, 2), torch.uint8)  # fp8 caches are uint8
    lay = describe_layer(info("l0", t), Geometry(NB, BS, 1, latent, mla=True))
    assert (lay.kind, lay.order, lay.item_bytes) == ("mla", "", BS * latent)
    check_marks(raw, t, lay, mla_write, head_size=latent)
    with pytest.raises(LayoutError, match=r"MLA .*expected \(num_blocks, block_size, latent\)"):
        describe_layer(info("l0", t.view(NB, BS, 2, latent // 2)),
                       Geometry(NB, BS, 1, latent, mla=True))


def test_kernel_blocks_smaller_than_vllm_blocks():
    # --block-size 32 with a backend whose kernel block is 16: twice as many blocks of 16.
    raw = raw_bytes(2 * NB * PAGE * 2)
    t = vllm_view(raw, (2 * NB, H, BS, 2 * D), (0, 1, 2, 3), torch.float16)
    lay = describe_layer(info("l0", t), Geometry(NB, 2 * BS, H, D))
    assert (lay.blocks_per_block, lay.kernel_block_size, lay.kernel_blocks) == (2, BS, 2 * NB)
    check_marks(raw, t, lay, packed_write)
    assert expand_blocks([3, 1], 2) == [6, 7, 2, 3] and expand_blocks([3, 1], 1) == [3, 1]
    with pytest.raises(LayoutError, match="do not divide vLLM's 6 blocks of 48 tokens"):
        describe_layer(info("l0", t), Geometry(NB, 3 * BS, H, D))


def test_padded_pages_move_whole():
    stride = PAGE * 2 + 256  # page_size_padded
    raw = raw_bytes(NB * stride)
    t = vllm_view(raw, (NB, H, BS, 2 * D), (0, 1, 2, 3), torch.float16, page_stride_bytes=stride)
    lay = describe_layer(info("l0", t), GEO)
    assert (lay.item_bytes, lay.page_bytes, lay.sliceable) == (stride, PAGE * 2, False)
    check_marks(raw, t, lay, packed_write)
    d = describe_layers([info("l0", t)], GEO)
    assert d.page_layout == f"vllm-packed-hnd-padded{stride}" and not d.sliceable


def test_layers_packed_into_one_backing_buffer():
    # KVCacheTensor(offset, block_stride): every layer's page of a block next to each other.
    layers = 3
    block_stride = layers * PAGE * 2
    raw = raw_bytes(NB * block_stride)
    ts = [vllm_view(raw, (NB, H, BS, 2 * D), (0, 1, 2, 3), torch.float16,
                    packing=(i * PAGE * 2, block_stride)) for i in range(layers)]
    d = describe_layers([info(f"l{i}", t) for i, t in enumerate(ts)], GEO)
    assert d.cross_layer and d.num_layers == layers and not d.sliceable
    assert d.buffers == [(raw.data_ptr(), NB * block_stride, block_stride)]
    assert d.page_layout == f"vllm-packed-hnd-cross-layer3-padded{block_stride}"


def test_shared_tensors_count_once_and_kv_split_orders_k_then_v():
    page = H * BS * D * 2
    a = vllm_view(raw_bytes(2 * NB * page), (2, NB, BS, H, D), (0, 1, 3, 2, 4), torch.float16)
    b = vllm_view(raw_bytes(2 * NB * page), (2, NB, BS, H, D), (0, 1, 3, 2, 4), torch.float16)
    d = describe_layers([info("x", a), info("y", a), info("z", b)], GEO)
    assert d.num_layers == 2 and d.layer_names == ["x", "z"]
    assert d.buffers == [(a.data_ptr(), NB * page, page), (b.data_ptr(), NB * page, page),
                         (a.data_ptr() + NB * page, NB * page, page),
                         (b.data_ptr() + NB * page, NB * page, page)]
    assert d.page_layout == "vllm-kv_split-hnd" and d.sliceable


def test_mamba_state_pages():
    page = 1000
    raw = raw_bytes(NB * page)
    t = raw[:NB * page].view(NB, 1, 1, page)
    assert describe_state_pages([info("m", t), info("m2", t)], NB, page) == \
        [(raw.data_ptr(), NB * page, page)]
    with pytest.raises(LayoutError, match="state .*expected 6 blocks of 2000"):
        describe_state_pages([info("m", t)], NB, 2 * page)


REFUSED = [
    # nvfp4 FlashInfer: (num_blocks, 2 * heads, block_size, full_dim)
    ("nvfp4", lambda: torch.zeros(NB, 2 * H, BS, 10, dtype=torch.uint8), GEO,
     "holds 4 heads of 10 elements; the KV cache spec says 2 heads"),
    ("blocks", lambda: torch.zeros(NB + 1, H, BS, 2 * D), GEO, "do not divide"),
    ("6-D", lambda: torch.zeros(2, NB, BS, H, D, 1), GEO, "pdlib reads the packed layout"),
    ("kv-2", lambda: torch.zeros(2, 2, BS, H, D), Geometry(2, BS, H, D), "cannot be told apart"),
    ("5-D no kv", lambda: torch.zeros(NB, 3, BS, H, D), GEO, "a 5-D KV cache must be"),
    ("elements", lambda: torch.zeros(NB, H, 2 * D, BS).transpose(2, 3), GEO,
     "not one dense piece with contiguous elements"),
    ("heads apart", lambda: torch.zeros(NB, 2 * H, BS, 2 * D)[:, ::2], GEO, "not one dense"),
    ("broadcast", lambda: torch.zeros(1, H, BS, 2 * D).expand(NB, H, BS, 2 * D), GEO,
     "zero or negative stride"),
    ("overlap", lambda: torch.zeros(NB * PAGE).as_strided((NB, H, BS, 2 * D),
                                                          (PAGE // 2, BS * 2 * D, 2 * D, 1)),
     GEO, "blocks overlap"),
]


@pytest.mark.parametrize("what, make, geo, says", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_layouts_name_shape_strides_and_need(what, make, geo, says):
    t = make()
    with pytest.raises(LayoutError) as e:
        describe_layer(info("model.layers.0.attn", t), geo)
    assert says in str(e.value)
    assert f"of shape {tuple(t.shape)} (strides {tuple(t.stride())}" in str(e.value)


def test_one_layout_per_group_and_no_unexplained_aliasing():
    hnd = vllm_view(raw_bytes(NB * PAGE * 2), (NB, H, BS, 2 * D), (0, 1, 2, 3), torch.float16)
    nhd = vllm_view(raw_bytes(NB * PAGE * 2), (NB, H, BS, 2 * D), (0, 2, 1, 3), torch.float16)
    with pytest.raises(LayoutError, match="one layout per group"):
        describe_layers([info("a", hnd), info("b", nhd)], GEO)
    with pytest.raises(LayoutError, match="different dtypes"):
        describe_layers([info("a", hnd), info("b", hnd.to(torch.bfloat16))], GEO)
    # Two views of one buffer shifted by half a page: neither shared nor packed.
    raw = raw_bytes(NB * PAGE * 2 + PAGE)
    x = vllm_view(raw[:NB * PAGE * 2], (NB, H, BS, 2 * D), (0, 1, 2, 3), torch.float16)
    y = vllm_view(raw[PAGE:PAGE + NB * PAGE * 2], (NB, H, BS, 2 * D), (0, 1, 2, 3),
                  torch.float16)
    with pytest.raises(LayoutError, match="overlap in memory"):
        describe_layers([info("a", x), info("b", y)], GEO)
