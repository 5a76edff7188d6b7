"""One vLLM engine (EngineCore: a scheduler and its TP workers) around pdlib.vllm, replayed for
test_vllm: run as a process, driven by JSON lines on stdin, answering JSON lines on stdout.

The call sequence is upstream vLLM's, read at jsboige/vllm 6adad087 (upstream main of
2026-08-14; python/README.md lists each file's last change):
  * start-up (v1/engine/core.py, v1/worker/gpu_model_runner.py initialize_kv_cache): the KV
    cache config (one group per kind of layer; with several groups every KVCacheTensor is
    shared by one layer of each group, pages of one size), the workers allocate one raw int8
    buffer per KVCacheTensor and view each layer in its attention backend's shape and stride
    order (_reshape_kv_cache_tensors, gpu/attn_utils.py _reshape_attention_kv_cache: the
    layout get_kv_cache_layout() returns, i.e. the connector's get_required_kvcache_layout();
    Mamba layers a (num_blocks, 1, 1, page) view), then register_kv_caches; then the
    scheduler and its connector; set_xfer_handshake_metadata when workers export metadata.
  * Scheduler (v1/core/sched/scheduler.py): schedule()'s WAITING loop
    (_update_waiting_for_remote_kv, local prefix hit, get_num_new_matched_tokens,
    allocate_slots with delay_cache_blocks, update_state_after_alloc(request,
    get_blocks(request_id), num_external_tokens) for every admitted request (so twice for a
    remote load: at allocation and when it is scheduled after the load), num_computed_tokens
    set at once, WAITING_FOR_REMOTE_KVS), the SchedulerOutput with finished_req_ids,
    build_connector_meta, _update_after_schedule; update_from_output
    (_handle_invalid_blocks with the recompute policy, stop checks, _free_request ->
    _connector_finished: remove_skipped_blocks, then request_finished_all_groups for a
    SupportsHMA connector, else request_finished; _update_from_kv_xfer_finished);
    finish_requests for aborts (a WAITING_FOR_REMOTE_KVS request's blocks wait for
    finished_recving). Async scheduling (AsyncScheduler, EngineCore.step_with_batch_queue):
    the next step is scheduled before the last one's output is processed, a running request
    counting its output placeholders.
  * Workers (v1/worker/kv_connector_model_runner_mixin.py _get_kv_connector_output): per step
    bind_connector_metadata, start_load_kv, the forward (wait_for_layer_load / save_kv_layer
    per layer), wait_for_save, get_finished(finished_req_ids),
    get_block_ids_with_load_errors, get_kv_connector_stats, clear_connector_metadata; the
    executor's KVOutputAggregator reports an id once every worker has.
Simplifications, none of which the connector can see: one process (the workers are called in
turn, each with its own TP rank's tensors), no preemption, a prefix cache that never evicts,
one block pool for every group (as BlockPool), and a "model" whose forward writes a
deterministic KV value per (salt, token, position, layer, K/V, head, element) into the blocks
and a running state per (salt, tokens so far, layer, rank) into a Mamba group's block, so
decode can check every byte it loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import select
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vllm_standin"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.parallel_state import _standin_set_tp  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: E402
from vllm.v1.attention.backends.utils import _standin_set_layout  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402


def kv_values(salt: int, token: int, pos: int, layer: int, kv: int, heads: np.ndarray,
              dim: int) -> np.ndarray:
    """The KV the test model computes for one token: [heads, dim], small integers (exact in
    fp16). `heads` are global head indices, so a rank of any TP size knows its slice."""
    d = np.arange(dim)
    v = salt * 101 + token * 7 + pos * 13 + layer * 31 + kv * 17 + heads[:, None] * 5 + d * 3
    return (v % 251).astype(np.float16)


def state_values(salt: int, tokens: List[int], layer: int, rank: int, nbytes: int
                 ) -> np.ndarray:
    """The Mamba state the test model holds after `tokens`: bytes that depend on every token
    (a running state), the layer and the TP rank's share."""
    h = (salt * 131 + len(tokens) * 17 + layer * 29 + rank * 7 + sum(
        (i + 1) * t for i, t in enumerate(tokens))) % 65521
    return ((np.arange(nbytes) * 7 + h) % 253).astype(np.uint8)


# Attention backends' KV cache shapes and stride orders (logical shape, stride order for NHD,
# for HND), as vLLM had them since 2026-01 (jsboige/vllm history of
# vllm/v1/attention/backends/flash_attn.py and flashinfer.py):
#   packed       FlashAttention / FlashInfer / Triton from 51878e5b6 (2026-07-11) on: the
#                stand-in's FlashAttentionBackend (6adad087)
#   kv_first     FlashAttention up to 7e33081ce (2026-05-26), read at 130d6c9514 (2026-01-15):
#                (2, num_blocks, block_size, heads, head_size), NHD (0,1,2,3,4), HND (0,1,3,2,4)
#   blocks_first FlashAttention 7e33081ce..51878e5b6 and FlashInfer before 51878e5b6:
#                (num_blocks, 2, block_size, heads, head_size), NHD (0,1,2,3,4), HND (0,1,3,2,4)
#   mla          (num_blocks, block_size, latent), no stride order
def kv_shape_and_order(layout: str, nb: int, bs: int, h: int, d: int
                       ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    hnd = get_kv_cache_layout() == "HND"
    if layout == "packed":
        return (FlashAttentionBackend.get_kv_cache_shape(nb, bs, h, d),
                FlashAttentionBackend.get_kv_cache_stride_order())
    if layout == "kv_first":
        return (2, nb, bs, h, d), ((0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4))
    if layout == "blocks_first":
        return (nb, 2, bs, h, d), ((0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4))
    return (nb, bs, d), (0, 1, 2)


def reshape_attention(raw: torch.Tensor, shape: Tuple[int, ...], order: Tuple[int, ...],
                      dtype: torch.dtype) -> torch.Tensor:
    """gpu/attn_utils.py _reshape_attention_kv_cache @6adad087 (no padding, no packing): the
    raw bytes viewed in stride order, permuted back to the logical shape."""
    permuted = tuple(shape[i] for i in order)
    inv = [order.index(i) for i in range(len(order))]
    return raw.view(dtype).view(permuted).permute(*inv)


class Worker:
    """One TP rank: its connector (role WORKER) and its KV cache tensors, allocated and
    registered the way GPUModelRunner.initialize_kv_cache does it (one raw int8 buffer per
    KVCacheTensor, shared by the layers it names, each layer's view in its backend's stride
    order; Mamba layers a (num_blocks, 1, 1, page) view of the same buffer)."""

    def __init__(self, engine: "Engine", rank: int) -> None:
        c = engine.cfg
        _standin_set_tp(rank, c["tp"])
        self.rank = rank
        self.layout = c["layout"]
        self.block_size = c["block_size"]
        self.kernel = c.get("kernel_block_size", self.block_size)
        self.k = self.block_size // self.kernel
        self.groups = engine.kv_cache_config.kv_cache_groups
        if self.layout == "mla":
            self.heads = np.zeros(1, dtype=np.int64)
        else:
            local = max(1, c["heads"] // c["tp"])
            first = rank * c["heads"] // c["tp"] if c["heads"] >= c["tp"] else \
                rank // (c["tp"] // c["heads"])
            self.heads = np.arange(first, first + local)
        self.connector = KVConnectorFactory.create_connector(
            engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config)
        cfg = engine.kv_cache_config
        nb = cfg.num_blocks
        self.pool = None
        total = sum(t.size for t in cfg.kv_cache_tensors)
        if c.get("pool_mode"):
            # Benchmark: the cache in one UCX-allocated pool, as pdlib-transfer-bench's default
            # --pool-alloc (UCX shm then copies into it directly; malloc'd memory needs a
            # syscall per read). vLLM's own cache is GPU memory.
            import pdlib
            mode = pdlib.Mode.Prefill if c["pool_mode"] == "prefill" else pdlib.Mode.Decode
            self.pool = pdlib.allocate_kv_pool("ucx", total, pdlib.MemoryKind.Host,
                                               c["extra"]["backend_options"], mode)
            flat = torch.frombuffer(self.pool.view(), dtype=torch.int8)
        else:
            flat = torch.zeros(total, dtype=torch.int8)
        # _allocate_kv_cache_tensors: one raw buffer per KVCacheTensor, every layer it names.
        raw: Dict[str, torch.Tensor] = {}
        at = 0
        for t in cfg.kv_cache_tensors:
            for name in t.shared_by:
                raw[name] = flat[at:at + t.size]
            at += t.size
        # _reshape_kv_cache_tensors, group by group.
        self.caches: Dict[str, torch.Tensor] = {}
        self.kind: Dict[str, str] = {}
        self.layer_index: Dict[str, int] = {}
        for g in self.groups:
            spec = g.kv_cache_spec
            for i, name in enumerate(g.layer_names):
                self.layer_index[name] = i
                if isinstance(spec, MambaSpec):
                    page = spec.page_size_bytes
                    self.caches[name] = raw[name][:nb * page].view(nb, 1, 1, page)
                    self.kind[name] = "mamba"
                    continue
                shape, order = kv_shape_and_order(self.layout, nb * self.k, self.kernel,
                                                  spec.num_kv_heads, spec.head_size)
                self.caches[name] = reshape_attention(raw[name], shape, order, spec.dtype)
                self.kind[name] = "swa" if isinstance(spec, SlidingWindowSpec) else "full"
        self.model = c.get("model", True)
        if not self.model:  # benchmark: no model, the blocks hold random bytes
            for t in self.caches.values():
                if t.dtype == torch.float16:
                    t.uniform_(-1, 1)
        self.connector.register_kv_caches(self.caches)

    def _slot(self, name: str, kv: int, block: int, offset: int) -> torch.Tensor:
        """[heads, head_size] (MLA: [latent]) of one token of one vLLM block."""
        t = self.caches[name]
        kb, off = block * self.k + offset // self.kernel, offset % self.kernel
        if self.layout == "packed":
            d = t.shape[-1] // 2
            return t[kb, :, off, kv * d:(kv + 1) * d]
        if self.layout == "kv_first":
            return t[kv, kb, off]
        if self.layout == "blocks_first":
            return t[kb, kv, off]
        return t[kb, off]

    def _dim(self, name: str) -> int:
        t = self.caches[name]
        return t.shape[-1] // 2 if self.layout == "packed" else t.shape[-1]

    def write(self, salt: int, tokens: List[int], tables: List[List[int]], start: int,
              n: int) -> None:
        """The forward of tokens [start, start + n): KV of every attention layer into the
        blocks of its group's table, the running state into the Mamba group's block."""
        if not self.model:
            return
        for name in self.caches:
            self.connector.wait_for_layer_load(name)
            group = self._group_of(name)
            blocks = tables[group]
            layer = self.layer_index[name]
            if self.kind[name] == "mamba":
                if blocks:
                    page = self.caches[name][blocks[-1]].view(-1).view(torch.uint8)
                    page.copy_(torch.from_numpy(state_values(
                        salt, tokens[:start + n], layer, self.rank, page.numel())))
            else:
                for pos in range(start, start + n):
                    block, offset = blocks[pos // self.block_size], pos % self.block_size
                    for kv in ((0,) if self.layout == "mla" else (0, 1)):
                        vals = kv_values(salt, tokens[pos], pos, layer + 100 * group, kv,
                                         self.heads, self._dim(name))
                        self._slot(name, kv, block, offset).copy_(
                            torch.from_numpy(vals[0] if self.layout == "mla" else vals))
            self.connector.save_kv_layer(name, self.caches[name], None)

    def _group_of(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if name in g.layer_names:
                return i
        raise KeyError(name)

    def check(self, salt: int, tokens: List[int], tables: List[List[int]], start: int,
              end: int, skip_blocks: Set[int], window: Optional[int] = None
              ) -> Tuple[int, int]:
        """(bytes checked, bytes wrong) of tokens [start, end) against salt's values: every
        full-attention layer; sliding-window layers for the tokens of the window that ends at
        `end` (window tokens); Mamba layers' state after tokens[:end]."""
        checked = wrong = 0
        for name in self.caches:
            group = self._group_of(name)
            blocks = tables[group]
            layer = self.layer_index[name]
            if self.kind[name] == "mamba":
                if blocks and start < end and blocks[-1] not in skip_blocks:
                    have = self.caches[name][blocks[-1]].view(-1).view(torch.uint8).numpy()
                    want = state_values(salt, tokens[:end], layer, self.rank, have.size)
                    checked += have.nbytes
                    wrong += int((have != want).sum())
                continue
            first = start
            if self.kind[name] == "swa" and window is not None:
                first = max(start, end - window)
            for pos in range(first, end):
                block, offset = blocks[pos // self.block_size], pos % self.block_size
                if block in skip_blocks or block == 0:
                    continue
                for kv in ((0,) if self.layout == "mla" else (0, 1)):
                    want = kv_values(salt, tokens[pos], pos, layer + 100 * group, kv,
                                     self.heads, self._dim(name))
                    have = self._slot(name, kv, block, offset).numpy()
                    want = want[0] if self.layout == "mla" else want
                    checked += have.nbytes
                    wrong += int((have != want).sum()) * 2
        return checked, wrong

    def untouched(self, outside: Set[int]) -> int:
        """Bytes of the blocks in `outside` that are not zero (nothing may write them)."""
        bad = 0
        for name, t in self.caches.items():
            for b in outside:
                if self.kind[name] == "mamba":
                    bad += int((t[b] != 0).sum())
                else:
                    for j in range(self.k):
                        bad += int((t.select(0 if self.layout != "kv_first" else 1,
                                             b * self.k + j) != 0).sum())
        return bad


class Engine:
    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cfg = cfg
        self.salt = cfg["salt"]
        self.enable_prefix_caching = cfg.get("enable_prefix_caching", True)
        self.block_size = cfg["block_size"]
        self.async_scheduling = cfg.get("async_scheduling", False)
        kinds = cfg.get("groups", ["full"])
        self.window = cfg.get("window", 2 * cfg["block_size"])
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model="pdlib-test-model", total_num_kv_heads=cfg["heads"],
                                     head_size=cfg["head_dim"],
                                     use_mla=cfg["layout"] == "mla"),
            cache_config=CacheConfig(block_size=cfg["block_size"],
                                     num_gpu_blocks=cfg["num_blocks"]),
            parallel_config=ParallelConfig(tensor_parallel_size=cfg["tp"]),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdlibConnector", kv_connector_module_path="pdlib.vllm",
                kv_role=cfg.get("kv_role", "kv_both"),
                kv_connector_extra_config=cfg["extra"],
                kv_load_failure_policy="recompute"))
        # get_kv_connector_cache_layout(): the connector class's wish, before allocation
        # (VLLM_KV_CACHE_LAYOUT, when set, wins).
        import importlib
        cls = getattr(importlib.import_module("pdlib.vllm"), "PdlibConnector")
        wish = cls.get_required_kvcache_layout(self.vllm_config)
        _standin_set_layout("NHD" if cfg.get("nhd") else wish)
        self.required_layout = "NHD" if cfg.get("nhd") else (wish or "NHD")
        self.kv_cache_config = self._kv_cache_config(cfg, kinds)
        self.workers = [Worker(self, r) for r in range(cfg["tp"])]
        self.connector = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        metadata = {w.rank: w.connector.get_handshake_metadata() for w in self.workers}
        if any(m is not None for m in metadata.values()):
            self.connector.set_xfer_handshake_metadata(metadata)
        # Scheduler state (block 0 is vLLM's null block, never handed out; one pool for every
        # group, as BlockPool is).
        self.free_blocks: List[int] = list(range(1, cfg["num_blocks"]))
        if cfg.get("scatter_blocks"):  # a pool after churn: a request's blocks far apart
            random.Random(self.salt).shuffle(self.free_blocks)
        self.null = KVCacheBlock(0, is_null=True)
        self.cached: Dict[Tuple[int, ...], KVCacheBlock] = {}
        self.req_blocks: Dict[str, List[List[KVCacheBlock]]] = {}
        self.requests: Dict[str, Request] = {}
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished_req_ids: Set[str] = set()
        self.finished_recving_kv_req_ids: Set[str] = set()
        self.failed_recving_kv_req_ids: Set[str] = set()
        self.hit_tokens: Dict[str, int] = {}
        self.report_counts: Dict[Tuple[str, str], int] = {}
        self.events: List[Dict[str, Any]] = []
        self.in_flight: List[Tuple[SchedulerOutput, KVConnectorOutput, Set[str]]] = []
        self.ever_allocated: Set[int] = {0}

    def _kv_cache_config(self, cfg: Dict[str, Any], kinds: List[str]) -> KVCacheConfig:
        """What vLLM's get_kv_cache_configs builds: one group per kind of layer, each group
        `layers` layers; with several groups every KVCacheTensor is shared by one layer of each
        group and every page has the attention page's size (Mamba's padded up to it)."""
        tp, bs = cfg["tp"], cfg["block_size"]
        mla = cfg["layout"] == "mla"
        heads = 1 if mla else max(1, cfg["heads"] // tp)
        dtype = torch.uint8 if cfg.get("fp8") else torch.float16
        if mla:
            attn = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=cfg["head_dim"],
                                    dtype=dtype)
        else:
            attn = FullAttentionSpec(block_size=bs, num_kv_heads=heads,
                                     head_size=cfg["head_dim"], dtype=dtype)
        page = attn.page_size_bytes
        specs: List[Any] = []
        for kind in kinds:
            if kind == "full":
                specs.append(attn)
            elif kind == "swa":
                specs.append(SlidingWindowSpec(block_size=bs, num_kv_heads=heads,
                                               head_size=cfg["head_dim"], dtype=dtype,
                                               sliding_window=self.window))
            else:  # conv and SSM state of this rank's heads, padded to the attention page
                specs.append(MambaSpec(block_size=cfg.get("max_model_len", 4096),
                                       shapes=((3, 8 * heads), (heads, 4, 8)),
                                       dtypes=(torch.float16, torch.float16),
                                       page_size_padded=page))
        names = [[f"model.layers.{g * cfg['layers'] + i}.attn" for i in range(cfg["layers"])]
                 for g in range(len(kinds))]
        nb = cfg["num_blocks"]
        tensors = [KVCacheTensor(size=nb * page, shared_by=[names[g][i] for g in
                                                            range(len(kinds))])
                   for i in range(cfg["layers"])]
        return KVCacheConfig(num_blocks=nb, kv_cache_tensors=tensors,
                             kv_cache_groups=[KVCacheGroupSpec(layer_names=names[g],
                                                               kv_cache_spec=specs[g])
                                              for g in range(len(kinds))])

    # -- the block pool (KVCacheManager, one table per group) -------------------------------

    def _group_kind(self, g: int) -> str:
        spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
        return "mamba" if isinstance(spec, MambaSpec) else \
            "swa" if isinstance(spec, SlidingWindowSpec) else "full"

    def _allocate(self, req: Request, num_tokens: int, hit: List[KVCacheBlock]) -> bool:
        groups = len(self.kv_cache_config.kv_cache_groups)
        tables = self.req_blocks.setdefault(
            req.request_id, [list(hit) if g == 0 else [] for g in range(groups)])
        need = []
        for g in range(groups):
            want = 1 if self._group_kind(g) == "mamba" else -(-num_tokens // self.block_size)
            need.append(max(0, want - len(tables[g])))
        if sum(need) > len(self.free_blocks):
            return False
        for g, n in enumerate(need):
            for _ in range(n):
                tables[g].append(KVCacheBlock(self.free_blocks.pop(0)))
                self.ever_allocated.add(tables[g][-1].block_id)
        return True

    def tables(self, req_id: str) -> List[List[int]]:
        return [[b.block_id for b in t] for t in self.req_blocks[req_id]]

    def _lookup(self, req: Request) -> Tuple[List[KVCacheBlock], int]:
        if not self.enable_prefix_caching:
            return [], 0
        tokens = req._all_token_ids
        hit: List[KVCacheBlock] = []
        for i in range((req.num_tokens - 1) // self.block_size):
            block = self.cached.get(tuple(tokens[:(i + 1) * self.block_size]))
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        for i, block in enumerate(self.req_blocks[req.request_id][0][
                :num_tokens // self.block_size]):
            key = tuple(req._all_token_ids[:(i + 1) * self.block_size])
            if block.block_hash is None and key not in self.cached:
                block.block_hash = key
                self.cached[key] = block

    def _remove_skipped_blocks(self, req: Request) -> None:
        """SlidingWindowManager.remove_skipped_blocks: blocks wholly before the window of the
        next token are freed and replaced by the null block."""
        skipped = max(0, req.num_computed_tokens - self.window + 1)
        for g, table in enumerate(self.req_blocks.get(req.request_id, [])):
            if self._group_kind(g) != "swa":
                continue
            for i in range(min(len(table), skipped // self.block_size)):
                if not table[i].is_null:
                    self.free_blocks.append(table[i].block_id)
                    table[i] = self.null

    def _free(self, req: Request) -> None:
        for table in self.req_blocks.pop(req.request_id, []):
            for block in table:
                if block.block_hash is None and not block.is_null:
                    self.free_blocks.append(block.block_id)

    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- Scheduler ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def schedule(self) -> Tuple[SchedulerOutput, Dict[str, Tuple[int, int]], Set[str]]:
        """One schedule(): the output, each scheduled request's token range and the requests
        that sample a token this step (the replay's own bookkeeping, kept off the output)."""
        scheduled: Dict[str, int] = {}
        for req in self.running:
            # With async scheduling a request runs again before its last token is known: its
            # placeholders count as tokens (AsyncScheduler._update_after_schedule), except
            # when the step in flight already reaches max_tokens.
            if req.num_output_placeholders > 0 and req.num_computed_tokens + 2 - \
                    req.num_output_placeholders >= req.num_prompt_tokens + req.max_tokens:
                continue
            n = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            if n > 0 and self._allocate(req, req.num_computed_tokens + n, []):
                scheduled[req.request_id] = n
        skipped: List[Request] = []
        while self.waiting:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if self._update_waiting_for_remote_kv(req):
                    req.status = RequestStatus.WAITING
                else:
                    skipped.append(self.waiting.pop(0))
                    continue
            ext, load_async = 0, False
            if req.num_computed_tokens == 0:
                hit, local = self._lookup(req)
                ext, load_async = self.connector.get_num_new_matched_tokens(req, local)
                if ext is None:
                    skipped.append(self.waiting.pop(0))
                    continue
                req.num_external_computed_tokens = ext
                num_computed = local + ext
            else:
                hit, local, num_computed = [], 0, req.num_computed_tokens
            num_new = 0 if load_async else req.num_tokens - num_computed
            if not self._allocate(req, num_computed + num_new, hit):
                break
            self.hit_tokens[req.request_id] = local
            self.connector.update_state_after_alloc(
                req, KVCacheBlocks(tuple(self.req_blocks[req.request_id])), ext)
            self.waiting.pop(0)
            req.num_computed_tokens = num_computed
            if load_async:
                skipped.append(req)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                continue
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled[req.request_id] = num_new
        self.waiting = skipped + self.waiting
        out = SchedulerOutput(num_scheduled_tokens=scheduled,
                              total_num_scheduled_tokens=sum(scheduled.values()),
                              finished_req_ids=self.finished_req_ids)
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        ranges = {}
        samples: Set[str] = set()
        for req_id, n in scheduled.items():  # _update_after_schedule
            req = self.requests[req_id]
            ranges[req_id] = (req.num_computed_tokens, n)
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                samples.add(req_id)
                if self.async_scheduling:
                    req.num_output_placeholders += 1
        self.finished_req_ids = set()
        return out, ranges, samples

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        if req.request_id not in self.finished_recving_kv_req_ids:
            return False
        if req.request_id in self.failed_recving_kv_req_ids:
            if req.num_computed_tokens:
                self._cache_blocks(req, req.num_computed_tokens)
            else:
                self._free(req)
            self.failed_recving_kv_req_ids.remove(req.request_id)
        else:
            self._cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(req.request_id)
        return True

    def finish_requests(self, req_id: str, status: RequestStatus) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished():
            return
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        delay = False
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            delay = req_id not in self.finished_recving_kv_req_ids
            self.finished_recving_kv_req_ids.discard(req_id)
            self.failed_recving_kv_req_ids.discard(req_id)
        req.status = status
        self._free_request(req, delay)

    def _connector_finished(self, req: Request) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Scheduler._connector_finished @6adad087: out-of-window blocks freed first, then one
        block list per group to a SupportsHMA connector, else the single group's list."""
        self._remove_skipped_blocks(req)
        block_ids = tuple(self.tables(req.request_id)) if req.request_id in self.req_blocks \
            else tuple([] for _ in self.kv_cache_config.kv_cache_groups)
        if not isinstance(self.connector, SupportsHMA):
            assert len(self.kv_cache_config.kv_cache_groups) == 1
            return self.connector.request_finished(req, block_ids[0])
        return self.connector.request_finished_all_groups(req, block_ids)

    def _free_request(self, req: Request, delay_free_blocks: bool = False
                      ) -> Optional[Dict[str, Any]]:
        delay, params = self._connector_finished(req)
        self.finished_req_ids.add(req.request_id)
        if not (delay or delay_free_blocks):
            self._free_blocks(req)
        self.events.append({"event": "finished", "id": req.request_id,
                            "status": req.status.name, "kv_transfer_params": params,
                            "num_computed_tokens": req.num_computed_tokens,
                            "output_len": req.num_output_tokens})
        return params

    def _free_blocks(self, req: Request) -> None:
        self._free(req)
        del self.requests[req.request_id]

    def update_from_output(self, out: SchedulerOutput, kvo: KVConnectorOutput,
                           samples: Set[str]) -> None:
        if kvo.invalid_block_ids:
            self.events.append({"event": "load_errors", "blocks": sorted(kvo.invalid_block_ids)})
            self._handle_invalid_blocks(kvo.invalid_block_ids)
        for req_id in out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished() or req_id not in samples:
                continue
            if self.async_scheduling:
                req.num_output_placeholders -= 1
            self._cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)
            req.append_output_token_ids(1000 + req.num_output_tokens)
            if req.num_output_tokens >= req.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.running.remove(req)
                req.num_output_placeholders = 0
                self._free_request(req)
        self.connector.update_connector_output(kvo)
        for req_id in kvo.finished_recving or ():
            assert req_id in self.requests, req_id
            req = self.requests[req_id]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
                self.events.append(self._received(req, kvo.invalid_block_ids))
            else:
                assert RequestStatus.is_finished(req.status)
                self._free_blocks(req)
                self.events.append({"event": "freed", "id": req_id, "side": "decode"})
        for req_id in kvo.finished_sending or ():
            assert req_id in self.requests, req_id
            self._free_blocks(self.requests[req_id])
            self.events.append({"event": "freed", "id": req_id, "side": "prefill"})

    def _handle_invalid_blocks(self, invalid: Set[int]) -> None:
        # _update_requests_with_invalid_blocks @6adad087, recompute policy, async loads (the
        # only kind this connector makes): the request is cut at its first invalid block.
        for req in self.waiting:
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            # Upstream's own line (with its "TODO: add support for hybrid memory allocator"):
            # it raises for a request of more than one KV cache group.
            (req_block_ids,) = self.tables(req.request_id)
            computed = req.num_computed_tokens
            n = -(-computed // self.block_size)
            for idx, block in enumerate(req_block_ids[:n]):
                if block in invalid:
                    req.num_computed_tokens = idx * self.block_size
                    self.failed_recving_kv_req_ids.add(req.request_id)
                    break

    def _received(self, req: Request, invalid: Set[int]) -> Dict[str, Any]:
        """Checks what decode loaded, as soon as vLLM learns it arrived: tokens after the local
        prefix hit hold prefill's values (except blocks reported invalid), the hit's tokens
        still hold this engine's own, and no block outside the request's was written."""
        tables = self.tables(req.request_id)
        hit = self.hit_tokens[req.request_id]
        tokens = req._all_token_ids
        end = hit + req.num_external_computed_tokens  # what the load was to bring
        checked = wrong = kept_checked = kept_wrong = 0
        for w in (self.workers if self.cfg.get("model", True) else []):
            c, bad = w.check(self.cfg["remote_salt"], tokens, tables, hit, end, set(invalid),
                             self.window)
            checked, wrong = checked + c, wrong + bad
            c, bad = w.check(self.salt, tokens, tables, 0, hit, set())
            kept_checked, kept_wrong = kept_checked + c, kept_wrong + bad
        mine = {b for t in tables for b in t}
        return {"event": "received", "id": req.request_id, "t": time.monotonic(),
                "blocks": tables[0], "tables": tables, "hit_tokens": hit, "end": end,
                "invalid": sorted(b for b in invalid if b in mine), "bytes_checked": checked,
                "bytes_wrong": wrong, "prefix_bytes_checked": kept_checked,
                "prefix_bytes_wrong": kept_wrong}

    def untouched(self) -> int:
        """Non-zero bytes in blocks no request was ever given (the model writes only a
        request's own blocks, and every block starts zeroed): what a stray write would leave."""
        outside = set(range(self.cfg["num_blocks"])) - self.ever_allocated
        return sum(w.untouched(outside) for w in self.workers)

    # -- Executor -----------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, ranges: Dict[str, Tuple[int, int]]
                ) -> KVConnectorOutput:
        per_worker = []
        for w in self.workers:
            c = w.connector
            # The executor sends each worker the SchedulerOutput pickled (multiproc executor).
            c.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
            c.start_load_kv(None)
            for req_id, (start, n) in ranges.items():
                req = self.requests[req_id]
                w.write(self.salt, req._all_token_ids, self.tables(req_id), start,
                        min(n, req.num_tokens - start))
            c.wait_for_save()
            o = KVConnectorOutput()
            o.finished_sending, o.finished_recving = c.get_finished(out.finished_req_ids)
            o.invalid_block_ids = c.get_block_ids_with_load_errors()
            o.kv_connector_stats = c.get_kv_connector_stats()
            c.clear_connector_metadata()
            per_worker.append(o)
        # KVOutputAggregator: an id is finished once every worker reported it.
        merged = KVConnectorOutput(finished_sending=set(), finished_recving=set())
        for o in per_worker:
            merged.invalid_block_ids |= o.invalid_block_ids
            for kind, ids in (("send", o.finished_sending), ("recv", o.finished_recving)):
                for req_id in ids or ():
                    key = (kind, req_id)
                    self.report_counts[key] = self.report_counts.get(key, 0) + 1
                    if self.report_counts[key] == len(self.workers):
                        del self.report_counts[key]
                        target = merged.finished_sending if kind == "send" \
                            else merged.finished_recving
                        assert target is not None
                        target.add(req_id)
        return merged

    def step(self) -> bool:
        """One engine-core step; True when it did anything (scheduled or finished work).
        Async scheduling (EngineCore.step_with_batch_queue, batch queue of 2): the next step is
        scheduled before the previous one's output is processed."""
        out, ranges, samples = self.schedule()
        kvo = self.execute(out, ranges)
        self.in_flight.append((out, kvo, samples))
        done = []
        while self.in_flight and (not self.async_scheduling or len(self.in_flight) >= 2
                                  or not ranges):
            done.append(self.in_flight.pop(0))
            self.update_from_output(*done[-1])
        return bool(ranges or any(k.finished_sending or k.finished_recving for _, k, _ in done))

    def shutdown(self) -> None:
        self.connector.shutdown()
        for w in self.workers:
            w.connector.shutdown()


class Backoff:
    """The loop's idle wait, like pdlib-transfer-bench's drivers (bench_ranks.cc, Idler) but
    with fewer yields, since each pass here is a whole engine step (~100 us of Python), not one
    poll: a pass that changed nothing yields twice, then sleeps 20 us doubling up to 1 ms; a pass
    that did resets it. On a GPU vLLM steps back to back; here a busy loop would take the CPU
    that pdlib's progress threads copy with (2 cores)."""

    def __init__(self) -> None:
        self.delay, self.idle = 20e-6, 0
        try:  # prctl(PR_SET_TIMERSLACK, 1 us): short sleeps stay short
            import ctypes
            ctypes.CDLL(None).prctl(29, ctypes.c_ulong(1000), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def wait(self, progressed: bool) -> None:
        if progressed:
            self.delay, self.idle = 20e-6, 0
        elif self.idle < 2:
            self.idle += 1
            os.sched_yield()
        else:
            time.sleep(self.delay)
            self.delay = min(self.delay * 2, 1e-3)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        engine = Engine(cfg)
    except Exception as e:  # reported to the test, which asserts on it
        print(json.dumps({"event": "error", "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"event": "ready", "free_blocks": engine.num_free_blocks()}), flush=True)
    buf = b""
    idle = Backoff()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    engine.shutdown()
                    print(json.dumps({"event": "bye"}), flush=True)
                    return
                if cmd["op"] == "add":
                    extra = None if cmd.get("kv_transfer_params") is None else \
                        {"kv_transfer_params": cmd["kv_transfer_params"]}
                    engine.add_request(Request(
                        cmd["id"], cmd["prompt"],
                        SamplingParams(max_tokens=cmd["max_tokens"], extra_args=extra), None))
                elif cmd["op"] == "abort":
                    engine.finish_requests(cmd["id"], RequestStatus.FINISHED_ABORTED)
                elif cmd["op"] == "stats":
                    decode = sum(w.connector.pdlib_stats().get("decode", {}).get(
                        "bytes_transferred", 0) for w in engine.workers)
                    engine.events.append({"event": "stats",
                                          "free_blocks": engine.num_free_blocks(),
                                          "untouched_bad": engine.untouched(),
                                          "requests": sorted(engine.requests),
                                          "decode_bytes": decode})
        try:
            progressed = engine.step()
        except Exception:
            for event in engine.events:  # what the step did before it failed
                print(json.dumps(event), flush=True)
            print(json.dumps({"event": "error", "error": traceback.format_exc()}), flush=True)
            return
        for event in engine.events:
            print(json.dumps(event), flush=True)
        progressed = progressed or bool(engine.events)
        engine.events.clear()
        idle.wait(bool(ready) or progressed)


if __name__ == "__main__":
    main()
