"""SGLang's prefill and decode schedulers, replayed around pdlib.sglang as upstream calls a
transfer backend: sgl-project/sglang main at 3c69a4c744525be0146629fc5933e3ddab609fb2
(2026-08-22, read from the fork bytedance-iaas/sglang), python/sglang/srt/disaggregation/:

prefill.py (last changed fbafd1b1, 2026-08-21)
    PrefillBootstrapQueue._init_kv_manager, create_sender (keyword sender), finalize_bootstrap
    (pop_decode_prefix_len, init(num_pages, metadata_buffer_index)), pop_bootstrapped;
    SchedulerDisaggregationPrefillMixin.event_loop_normal_disagg_prefill,
    resolve_waiting_queue_bootstrap, process_prefill_chunk, maybe_send_cached_prefix_chunk
    (_early_send_wait_event), _send_kv_chunk (get_max_transfer_tokens, should_send_kv_chunk,
    send(page_indices, state_indices, num_kv_tokens=)), process_batch_result_disagg_prefill,
    process_disagg_prefill_inflight_queue (clear() then get_transfer_metric()),
    handle_bootstrap_failure, handle_inflight_transfer_failure, _retire_aborted_prefill_result
decode.py (0db2c53d, 2026-08-21)
    DecodePreallocQueue._init_kv_manager (no head counts), add, _resolve_prefill_dp_rank
    (prefill_info_table.get), _create_receiver_and_enqueue (keyword receiver), _init_receiver
    (init(prefill_dp_rank)), _resolve_pending_reqs / _ensure_prefill_info
    (try_ensure_parallel_info), prefetch_prefill_dp_rank_queries, _update_handshake_waiters,
    pop_preallocated (state payloads per StateType), _send_kv_metadata (send_metadata(...,
    decode_prefix_len=)); DecodeTransferQueue.pop_transferred (_poll_with_metadata_gate,
    deferred release), _commit_transfer_to_req (bootstrap_room check), resolve_deferred_releases
managers/scheduler.py (fbafd1b1, 2026-08-21) Scheduler.abort_request (both sides)

Model(newer_revision=True) replays what the newer, undated prefill.py @423bf210 and decode.py
@b7e89b39 do differently (python/README.md "SGLang" lists it): the KV checksum row
(set_kv_checksum / get_kv_checksum), num_draft_entries and rust_http_port on KVArgs, and a failed
transfer armed for the deferred release (ensure_abort_notified(force_arm=True)).

Every scheduler rank is a thread running the same loop (SPMD); poll_and_all_reduce is a MIN
all-reduce across them (sglang_standin.Group), and SGLang's illegal-state checks raise
ValueError/RuntimeError as upstream. KVArgs and server_args are bare SGLang shapes (no pdlib
attribute). Pools are numpy: prefill writes a pattern per (room, buffer, page position) and
decode checks every byte of every page, state row and metadata row it received, and, after
every request, that every page and row not handed over still holds what it held (a shadow
copy): a late or stray write fails the test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pdlib.sglang_plugin import kv_classes
from sglang_standin import (
    DisaggregationMode,
    Group,
    KVArgs,
    KVArgsNewer,
    KVPoll,
    MetadataBuffers,
    RankGroup,
    ReqToMetadataIdxAllocator,
    StateType,
    kv_to_page_indices,
    kv_to_page_num,
    poll_and_all_reduce,
    poll_and_all_reduce_attn_cp_tp_group,
)

CLASSES = kv_classes()  # what get_kv_class returns for "pdlib" (the plugin's mapping)


def first_token(room: int) -> int:
    return (room * 2654435761) % 32000


def pattern(seed: int, shape: Tuple[int, ...], *key: int) -> np.ndarray:
    return np.random.default_rng([seed, *key]).integers(0, 256, size=shape, dtype=np.uint8)


# ------------------------------------------------------------------------------------ model
@dataclasses.dataclass
class Model:
    """The model both sides serve and the pool sizes of each rank."""

    layers: int = 2
    kv_heads: int = 4
    head_bytes: int = 16  # head_dim 8 x bf16
    page_size: int = 4
    pool_pages: int = 64
    mla: bool = False
    latent_bytes: int = 48  # MLA: bytes per token
    draft_layers: int = 0  # draft-model K/V buffers appended after the target's
    families: Tuple[str, ...] = ()  # "mamba", "swa", "dsa", in KVArgs.state_types order
    mamba_buffers: int = 2
    mamba_item: int = 96
    mamba_slots: int = 24
    swa_pages: int = 64
    swa_window: int = 8  # tokens
    dsa_item: int = 32
    aux_slots: int = 32
    aux_dsa_dim: int = 0
    aux_sampling_tokens: int = 0
    aux_kv_checksum: str = ""  # "", "before" or "after" bootstrap_room (newer_revision only)
    # False: main @3c69a4c7 (2026-08-22). True: the newer, undated prefill.py @423bf210 /
    # decode.py @b7e89b39 (KV checksum row, ensure_abort_notified on a failed transfer).
    newer_revision: bool = False
    seed: int = 7

    def __post_init__(self) -> None:
        assert not self.aux_kv_checksum or self.newer_revision, \
            "main @3c69a4c7 has no KV checksum row (prefill.py @423bf210 / decode.py @b7e89b39)"

    def config(self) -> Dict[str, Any]:
        """config.json of model_path (what SGLang's ModelConfig reads)."""
        return {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": self.layers,
                "num_attention_heads": self.kv_heads * 2, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_bytes // 2, "hidden_size": self.kv_heads * 2 *
                (self.head_bytes // 2), "torch_dtype": "bfloat16"}

    def heads(self, tp: int, rank: int) -> List[int]:
        """The KV heads a rank holds (replicated when tp > heads)."""
        t = self.kv_heads
        if t >= tp:
            h = t // tp
            return list(range(rank * h, (rank + 1) * h))
        return [rank // (tp // t)]

    def kv_buffers(self) -> int:
        kinds = 1 if self.mla else 2
        return kinds * (self.layers + self.draft_layers)

    def kv_shape(self, tp: int) -> Tuple[int, ...]:
        if self.mla:
            return (self.pool_pages, self.page_size, 1, self.latent_bytes)
        return (self.pool_pages, self.page_size, len(self.heads(tp, 0)), self.head_bytes)

    def kv_page(self, room: int, buffer: int, pos: int, tp: int, rank: int) -> np.ndarray:
        if self.mla:
            return pattern(self.seed, (self.page_size, 1, self.latent_bytes), room, 1, buffer, pos)
        full = pattern(self.seed, (self.page_size, self.kv_heads, self.head_bytes), room, 1,
                       buffer, pos)
        return full[:, self.heads(tp, rank), :]

    def swa_page(self, room: int, buffer: int, pos: int, tp: int, rank: int) -> np.ndarray:
        full = pattern(self.seed, (self.page_size, self.kv_heads, self.head_bytes), room, 2,
                       buffer, pos)
        return full[:, self.heads(tp, rank), :]

    def mamba_row(self, room: int, buffer: int, tp: int, rank: int) -> np.ndarray:
        full = pattern(self.seed, (self.mamba_item,), room, 3, buffer)
        part = self.mamba_item // tp
        return full[rank * part:(rank + 1) * part]

    def dsa_row(self, room: int, pos: int) -> np.ndarray:
        return pattern(self.seed, (self.dsa_item,), room, 4, pos)


def write_config(model: Model, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config(), f)
    return directory


def server_args(**kw: Any) -> SimpleNamespace:
    """Only fields SGLang's ServerArgs has."""
    base = dict(host="127.0.0.1", port=30000, dist_init_addr=None, nnodes=1,
                disaggregation_bootstrap_port=8998, tp_size=1, dp_size=1, pp_size=1,
                enable_dp_attention=False, disaggregation_ib_device=None, kv_cache_dtype="auto",
                model_path=None, device="cpu", disaggregation_transfer_backend="pdlib",
                disaggregation_decode_allocation_policy="early", load_balance_method=None)
    base.update(kw)
    return SimpleNamespace(**base)



def kv_checksum(buffers: List[np.ndarray], pages: List[int]) -> int:
    """The replay's stand-in of SGLang's KV checksum of a request's pages on one rank: any
    function of every byte will do; never 0 (SGLang skips 0 as unwritten)."""
    h = 1469598103934665603
    for buf in buffers:
        for page in pages:
            h = (h * 1099511628211 + int(buf[page].view(np.uint8).astype(np.uint64).sum())) \
                % (1 << 63)
    return h or 1

# ------------------------------------------------------------------------------------ requests
@dataclasses.dataclass
class Spec:
    """One request as the router sends it to both sides, and what the test does to it."""

    room: int
    input_len: int
    decode_prefix_pages: int = 0  # decode's radix cache holds the first N pages
    prefill_cached_pages: int = 0  # prefill's radix cache: sent early, before the forward
    router_dp_rank: Optional[int] = None  # req.disagg_prefill_dp_rank
    misroute_dp_rank: Optional[int] = None  # sent to this prefill DP rank, no router rank
    prefill_abort: Optional[str] = None  # "bootstrap" | "chunk"
    decode_abort: Optional[str] = None  # "prealloc" | "transfer"
    hold: Optional[threading.Event] = None  # prefill forwards the request once it is set
    hold_forever: bool = False

    @property
    def rid(self) -> str:
        return f"req-{self.room}"


class FinishAbort:
    def __init__(self, message: str):
        self.message = message


class Req:
    """The fields of SGLang's Req the disaggregation code touches."""

    def __init__(self, spec: Spec, bootstrap_port: int):
        self.spec = spec
        self.rid = spec.rid
        self.bootstrap_room = spec.room
        self.bootstrap_host = "127.0.0.1"
        self.bootstrap_port = bootstrap_port
        self.origin_input_ids = list(range(spec.input_len))
        self.disagg_prefill_dp_rank = spec.router_dp_rank
        self.metadata_buffer_index = -1
        self.output_ids: List[int] = []
        self.finished_reason: Any = None
        self.start_send_idx = 0
        self.disagg_decode_prefix_len = 0
        self.pending_bootstrap = False
        self.disagg_kv_sender: Any = None
        self.extend_end = 0
        self.pages: List[int] = []
        self.state: Dict[str, List[int]] = {}
        self.to_abort = False


def prepare_abort(req: Req, message: str) -> None:
    req.finished_reason = FinishAbort(message)


class FakeEvent:
    """torch.cuda.Event stand-in for _early_send_wait_event."""

    def __init__(self, counter: List[int]):
        self.counter = counter

    def synchronize(self) -> None:
        self.counter[0] += 1


# ------------------------------------------------------------------------------------ pools
class Pools:
    """One rank's KV pools, state buffers and metadata buffers, with a shadow copy of what every
    page and row must hold while nobody writes it."""

    def __init__(self, model: Model, tp: int, rank: int, decode: bool, seed: int):
        self.model, self.tp, self.rank = model, tp, rank
        rng = np.random.default_rng([seed, rank, 99])
        self.kv = [rng.integers(0, 256, size=model.kv_shape(tp), dtype=np.uint8)
                   for _ in range(model.kv_buffers())]
        self.state: Dict[str, List[np.ndarray]] = {}
        heads = len(model.heads(tp, 0))
        for name in model.families:
            if name == "mamba":
                shape: Tuple[int, ...] = (model.mamba_slots, model.mamba_item // tp)
                count = model.mamba_buffers
            elif name == "swa":
                shape, count = (model.swa_pages, model.page_size, heads, model.head_bytes), 1
            elif name == "dsa":
                shape, count = (model.pool_pages, model.dsa_item), 1
            else:
                raise ValueError(name)
            self.state[name] = [rng.integers(0, 256, size=shape, dtype=np.uint8)
                                for _ in range(count)]
        self.meta = MetadataBuffers(model.aux_slots, hidden_size=8,
                                    max_sampling_mask_tokens=model.aux_sampling_tokens,
                                    output_dsa_topk_indices_dim=model.aux_dsa_dim,
                                    kv_checksum_position=model.aux_kv_checksum)
        self.shadow_kv = [b.copy() for b in self.kv]
        self.shadow_state = {k: [b.copy() for b in v] for k, v in self.state.items()}
        self.busy_pages: Dict[int, int] = {}  # handed-over page -> room (decode)
        self.busy_rows: Dict[Tuple[str, int], int] = {}
        self.rng = np.random.default_rng([seed, rank, 7])

    def reuse(self, pages: List[int], rows: Dict[str, List[int]]) -> None:
        """The engine gives these to another request: new bytes, and the shadow follows."""
        for b, buf in enumerate(self.kv):
            for p in pages:
                buf[p] = self.rng.integers(0, 256, size=buf[p].shape, dtype=np.uint8)
                self.shadow_kv[b][p] = buf[p]
        for name, indices in rows.items():
            for b, buf in enumerate(self.state[name]):
                for i in indices:
                    buf[i] = self.rng.integers(0, 256, size=buf[i].shape, dtype=np.uint8)
                    self.shadow_state[name][b][i] = buf[i]

    def check_untouched(self, where: str) -> None:
        """Every page and row not handed over to a live transfer holds its shadow bytes."""
        for b, buf in enumerate(self.kv):
            diff = np.nonzero(np.any(buf.reshape(len(buf), -1)
                                     != self.shadow_kv[b].reshape(len(buf), -1), axis=1))[0]
            bad = [int(p) for p in diff if int(p) not in self.busy_pages]
            assert not bad, f"{where}: rank {self.rank} kv buffer {b} pages {bad} changed " \
                            "while not handed over"
        for name, bufs in self.state.items():
            for b, buf in enumerate(bufs):
                diff = np.nonzero(np.any(buf.reshape(len(buf), -1)
                                         != self.shadow_state[name][b].reshape(len(buf), -1),
                                         axis=1))[0]
                bad = [int(i) for i in diff if (name, int(i)) not in self.busy_rows]
                assert not bad, f"{where}: rank {self.rank} {name} buffer {b} rows {bad} changed"


def make_kv_args(model: Model, pools: Pools, engine_rank: int, dp_rank: int,
                 prefill: bool) -> KVArgs:
    """prefill.py / decode.py _init_kv_manager and utils.setup_state_kv_args: what SGLang puts
    on its KVArgs, nothing more (decode: no head counts, no prefill_start_layer)."""
    a = KVArgsNewer() if model.newer_revision else KVArgs()
    a.engine_rank = engine_rank
    a.pp_rank = 0
    a.system_dp_rank = dp_rank
    a.kv_cache_dtype_str = "auto"
    if prefill:
        if model.newer_revision:  # prefill.py @423bf210; main @3c69a4c7 sets no rust_http_port
            a.rust_http_port = None
        a.prefill_start_layer = 0
        a.mla_compression_ratios = None
    target = 2 * model.layers if not model.mla else model.layers
    bufs = pools.kv
    a.kv_data_ptrs = [b.ctypes.data for b in bufs]
    a.kv_data_lens = [b.nbytes for b in bufs]
    a.kv_item_lens = [b[0].nbytes for b in bufs]
    if prefill:
        a.prefill_end_layer = None
    if model.newer_revision:  # main @3c69a4c7 appends the draft's buffers and says no more
        a.num_draft_entries = len(bufs) - target
    a.kv_layer_ids = []
    if prefill and not model.mla:
        a.kv_head_num = len(model.heads(pools.tp, 0))
        a.total_kv_head_num = model.kv_heads
    a.page_size = model.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = pools.meta.get_buf_infos()
    a.ib_device = None
    a.gpu_id = 0
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_layer_ids = [], [], []
    a.is_hybrid_mla_backend = False
    a.state_conv_shard_groups = []
    kinds = {"mamba": StateType.MAMBA, "swa": StateType.SWA, "dsa": StateType.DSA}
    for name in model.families:  # append_state_component
        state = pools.state[name]
        a.state_types.append(kinds[name])
        a.state_data_ptrs.append([b.ctypes.data for b in state])
        a.state_data_lens.append([b.nbytes for b in state])
        a.state_item_lens.append([b[0].nbytes for b in state])
        a.state_dim_per_tensor.append([0] * len(state) if name == "mamba" else [])
        a.state_conv_shard_groups.append([])
        a.state_slice_outer_counts.append([])
        a.state_layer_ids.append([])
    return a


# ------------------------------------------------------------------------------------ instance
class Instance:
    """One SGLang server (a prefill DP rank or a decode instance): `tp` scheduler ranks, each a
    thread running the scheduler's event loop; the test talks to rank 0 through an inbox."""

    def __init__(self, tp: int):
        self.tp = tp
        self.group = Group(tp)
        self._inbox: List[Tuple[str, Any]] = []
        self._lock = threading.Lock()
        self.results: Dict[int, Tuple[int, str]] = {}  # room -> (KVPoll, reason) of rank 0
        self.reasons: Dict[int, List[str]] = {}  # room -> every rank's reason
        self.metrics: Dict[int, Any] = {}
        self.errors: List[str] = []
        self.threads: List[threading.Thread] = []
        self.stopped = threading.Event()

    def submit(self, spec: Spec) -> None:
        """The request arrives; an abort the test wants at once arrives with it (SGLang's
        ingest_requests handles both before the loop body)."""
        with self._lock:
            self._inbox.append(("add", spec))
            if self.abort_at_once(spec):
                self._inbox.append(("abort", spec.rid))

    def abort_at_once(self, spec: Spec) -> bool:
        return False

    def stop(self) -> None:
        with self._lock:
            self._inbox.append(("stop", None))

    def start(self) -> None:
        for r in range(self.tp):
            t = threading.Thread(target=self._run, args=(r,), daemon=True,
                                 name=f"{type(self).__name__}-{r}")
            self.threads.append(t)
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not self.errors, "\n".join(self.errors)

    def _run(self, rank: int) -> None:
        sched = self.scheds[rank]
        try:
            while True:
                cmd = None
                if rank == 0:
                    with self._lock:
                        cmd, self._inbox = self._inbox, []
                    cmd = cmd + [("abort", rid) for rid in sched.due_aborts()]
                cmd = self.group.broadcast(rank, cmd)
                if any(kind == "stop" for kind, _ in cmd):
                    break
                for kind, value in cmd:
                    if kind == "add":
                        sched.add(value)
                    elif kind == "abort":
                        sched.abort_request(value)
                sched.step()
                time.sleep(0.0005)
        except BaseException:  # noqa: BLE001 - reported by join()
            self.errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            self.group.abort()
        finally:
            self.stopped.set()

    scheds: List[Any]


# ------------------------------------------------------------------------------------ prefill
class PrefillScheduler:
    """One prefill scheduler rank (non-overlap event loop, chunked prefill of `chunk` tokens)."""

    def __init__(self, inst: "PrefillInstance", rank: int):
        self.inst, self.rank = inst, rank
        m = inst.model
        self.model = m
        self.pools = Pools(m, inst.tp, rank, decode=False, seed=inst.seed + 1000 * inst.dp_rank)
        sa = inst.server_args
        self.kv_args = make_kv_args(m, self.pools, engine_rank=inst.dp_rank * inst.tp + rank,
                                    dp_rank=inst.dp_rank, prefill=True)
        self.kv_manager = CLASSES["manager"](self.kv_args, DisaggregationMode.PREFILL, sa,
                                             m.mla)
        self.bootstrap_port = sa.disaggregation_bootstrap_port
        self.tp_group = RankGroup(inst.group, rank)
        self.allocator = ReqToMetadataIdxAllocator(m.aux_slots)
        self.free_pages = list(range(m.pool_pages))
        self.free_slots = {"mamba": list(range(m.mamba_slots)), "swa": list(range(m.swa_pages))}
        self.rng = random.Random(inst.seed * 31 + inst.dp_rank)
        self.bootstrap_queue: List[Req] = []
        self.waiting_queue: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.inflight_queue: List[Req] = []
        self.early_syncs = [0]

    # ---- PrefillBootstrapQueue
    def add(self, spec: Spec) -> None:
        req = Req(spec, self.bootstrap_port)
        req.disagg_kv_sender = CLASSES["sender"](
            mgr=self.kv_manager,
            bootstrap_addr=f"{req.bootstrap_host}:{self.bootstrap_port}",
            bootstrap_room=req.bootstrap_room, dest_tp_ranks=[self.rank], pp_rank=0,
            req_has_disagg_prefill_dp_rank=req.disagg_prefill_dp_rank is not None)
        req.pending_bootstrap = True
        self.bootstrap_queue.append(req)

    def ensure_metadata_buffer(self, req: Req) -> bool:
        if req.metadata_buffer_index >= 0:
            return True
        if self.allocator.available_size() == 0:
            return False
        req.metadata_buffer_index = self.allocator.alloc()
        return True

    def finalize_bootstrap(self, req: Req) -> bool:
        assert req.pending_bootstrap
        if not self.ensure_metadata_buffer(req):
            return False
        decode_prefix_len = req.disagg_kv_sender.pop_decode_prefix_len()
        req.start_send_idx = decode_prefix_len
        req.disagg_decode_prefix_len = decode_prefix_len
        num_pages = kv_to_page_num(len(req.origin_input_ids) - decode_prefix_len,
                                   self.model.page_size)
        req.disagg_kv_sender.init(num_pages, req.metadata_buffer_index)
        req.pending_bootstrap = False
        return True

    def pop_bootstrapped(self) -> List[Req]:
        if not self.bootstrap_queue:
            return []
        polls = poll_and_all_reduce_attn_cp_tp_group(
            [req.disagg_kv_sender for req in self.bootstrap_queue], None, self.tp_group)
        done, keep = [], []
        for req, poll in zip(self.bootstrap_queue, polls):
            if poll == KVPoll.Failed:
                self.handle_bootstrap_failure(req)
            elif poll == KVPoll.Bootstrapping:
                keep.append(req)  # optimistic_prefill_attempts 0: wait in the queue
            elif poll == KVPoll.WaitingForInput:
                if not self.finalize_bootstrap(req):
                    keep.append(req)
                    continue
                done.append(req)
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for req {req.rid} in "
                                   "pop_bootstrapped")
        self.bootstrap_queue = keep
        return done

    # ---- SchedulerDisaggregationPrefillMixin
    def resolve_waiting_queue_bootstrap(self) -> None:
        candidates = [r for r in self.waiting_queue if r.finished_reason is None]
        if not candidates:
            return
        polls = poll_and_all_reduce_attn_cp_tp_group(
            [r.disagg_kv_sender for r in candidates], None, self.tp_group)
        failed = set()
        for req, poll in zip(candidates, polls):
            if poll == KVPoll.Failed:
                self.handle_bootstrap_failure(req)
                failed.add(id(req))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in failed]

    def handle_bootstrap_failure(self, req: Req) -> None:
        message = f"Prefill bootstrap failed for request rank={self.rank} {req.rid=}"
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as e:  # noqa: BLE001 - as upstream
            message += f" with exception {e}"
        self.release_kv(req)
        self.maybe_release_metadata_buffer(req)
        req.pending_bootstrap = False
        prepare_abort(req, message)
        self.finish(req, KVPoll.Failed, message)

    def maybe_release_metadata_buffer(self, req: Req) -> None:
        if req.metadata_buffer_index >= 0:
            self.allocator.free(req.metadata_buffer_index)
            req.metadata_buffer_index = -1

    def release_kv(self, req: Req) -> None:
        """release_kv_cache: the pages and slots go to the next request at once (new bytes)."""
        rows = dict(req.state)
        if "dsa" in self.model.families:
            rows["dsa"] = list(req.pages)
        self.pools.reuse(req.pages, rows)
        self.free_pages.extend(req.pages)
        for name in ("mamba", "swa"):
            self.free_slots[name].extend(req.state.get(name, []))
        req.pages, req.state = [], {}

    def finish(self, req: Req, state: int, reason: str, metric: Any = None) -> None:
        with self.inst._lock:
            self.inst.reasons.setdefault(req.bootstrap_room, []).append(reason)
        if self.rank == 0:
            self.inst.results[req.bootstrap_room] = (state, reason)
            if metric is not None:
                self.inst.metrics[req.bootstrap_room] = metric

    def due_aborts(self) -> List[str]:
        """Rank 0: the aborts the test asked for whose moment has come (a middle chunk sent)."""
        out = []
        c = self.chunked_req
        if c is not None and c.spec.prefill_abort == "chunk" and not c.to_abort \
                and c.start_send_idx > c.disagg_decode_prefix_len:
            c.to_abort = True
            out.append(c.rid)
        return out

    def abort_request(self, rid: str) -> None:
        """Scheduler.abort_request (prefill branch)."""
        for i, req in enumerate(list(self.waiting_queue)):
            if req.rid == rid:
                self.waiting_queue.remove(req)
                bootstrap_pending = req.pending_bootstrap
                self.maybe_release_metadata_buffer(req)
                if bootstrap_pending and req.disagg_kv_sender is not None:
                    req.disagg_kv_sender.abort()
                self.release_kv(req)
                self.finish(req, KVPoll.Failed, "aborted in the waiting queue")
        for req in self.bootstrap_queue:
            if req.rid == rid:
                req.disagg_kv_sender.abort()
        for req in self.inflight_queue:
            if req.rid == rid:
                req.disagg_kv_sender.abort()
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            self.chunked_req.finished_reason = FinishAbort("Aborted by AbortReq.")

    def step(self) -> None:
        """event_loop_normal_disagg_prefill, one iteration."""
        self.waiting_queue.extend(self.pop_bootstrapped())
        self.resolve_waiting_queue_bootstrap()
        self.process_prefill_chunk()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            self.run_batch(batch)
            self.process_batch_result_disagg_prefill(batch)
        self.process_disagg_prefill_inflight_queue()

    def process_prefill_chunk(self) -> None:
        req = self.chunked_req
        if req is not None and req.finished_reason is None:
            self.send_kv_chunk(req)  # non-overlap: the previous middle chunk goes now

    def get_new_batch_prefill(self) -> Optional[Req]:
        if self.chunked_req is not None:
            return self.chunked_req
        m = self.model
        for req in self.waiting_queue:
            if req.pending_bootstrap or req.finished_reason is not None:
                continue
            spec = req.spec
            if spec.hold_forever or (spec.hold is not None and not spec.hold.is_set()):
                continue
            need = kv_to_page_num(len(req.origin_input_ids), m.page_size)
            if len(self.free_pages) < need:
                return None
            self.waiting_queue.remove(req)
            req.pages = [self.free_pages.pop(self.rng.randrange(len(self.free_pages)))
                         for _ in range(need)]
            if "mamba" in m.families:
                req.state["mamba"] = [self.free_slots["mamba"].pop(0)]
            if "swa" in m.families:
                req.state["swa"] = [self.free_slots["swa"].pop(
                    self.rng.randrange(len(self.free_slots["swa"]))) for _ in range(need)]
            cached = spec.prefill_cached_pages * m.page_size
            self.write_kv(req, 0, cached)  # the radix cache's pages already hold the prefix
            req.extend_end = cached
            self.maybe_send_cached_prefix_chunk(req)
            return req
        return None

    def maybe_send_cached_prefix_chunk(self, req: Req) -> None:
        cached_end = req.spec.prefill_cached_pages * self.model.page_size
        if cached_end <= req.start_send_idx:
            return
        req.disagg_kv_sender._early_send_wait_event = FakeEvent(self.early_syncs)
        self.send_kv_chunk(req, last_chunk=False, end_idx=cached_end)

    def write_kv(self, req: Req, start: int, end: int) -> None:
        """The forward pass: the pages of tokens [start, end) get the request's pattern."""
        m = self.model
        first, last = start // m.page_size, kv_to_page_num(end, m.page_size)
        for b, buf in enumerate(self.pools.kv):
            for pos in range(first, last):
                buf[req.pages[pos]] = m.kv_page(req.bootstrap_room, b, pos, self.inst.tp,
                                                self.rank)

    def run_batch(self, req: Req) -> None:
        end = min(req.extend_end + self.inst.chunk, len(req.origin_input_ids))
        self.write_kv(req, req.extend_end, end)
        req.extend_end = end

    def write_state(self, req: Req) -> None:
        m, tp, r = self.model, self.inst.tp, self.rank
        room = req.bootstrap_room
        if "mamba" in m.families:
            for b, buf in enumerate(self.pools.state["mamba"]):
                buf[req.state["mamba"][0]] = m.mamba_row(room, b, tp, r)
        if "swa" in m.families:
            for pos in self.swa_positions(req):
                self.pools.state["swa"][0][req.state["swa"][pos]] = m.swa_page(room, 0, pos, tp, r)
        if "dsa" in m.families:
            for pos, page in enumerate(req.pages):
                self.pools.state["dsa"][0][page] = m.dsa_row(room, pos)

    def swa_positions(self, req: Req) -> range:
        m = self.model
        seq_len = len(req.origin_input_ids)
        window_start = max(req.disagg_decode_prefix_len, seq_len - m.swa_window)
        window_start = (window_start // m.page_size) * m.page_size
        return range(window_start // m.page_size, kv_to_page_num(seq_len, m.page_size))

    def process_batch_result_disagg_prefill(self, req: Req) -> None:
        if req.extend_end >= len(req.origin_input_ids):
            self.chunked_req = None
            if req.finished_reason is not None:
                self._retire_aborted_prefill_result(req)
                return
            req.output_ids.append(first_token(req.bootstrap_room))
            self.write_state(req)
            self.inflight_queue.append(req)
            self.send_kv_chunk(req, last_chunk=True)
        else:
            if req.finished_reason is not None:
                self.chunked_req = None
                self._retire_aborted_prefill_result(req)
                return
            self.chunked_req = req

    def _retire_aborted_prefill_result(self, req: Req) -> None:
        try:
            req.disagg_kv_sender.abort()
        except Exception:  # noqa: BLE001 - best effort, as upstream
            pass
        self.maybe_release_metadata_buffer(req)
        req.pending_bootstrap = False
        self.release_kv(req)  # at once, without polling: upstream does the same
        self.finish(req, KVPoll.Failed, "aborted during prefill")

    def send_kv_chunk(self, req: Req, last_chunk: bool = False,
                      end_idx: Optional[int] = None) -> None:
        """_send_kv_chunk."""
        m = self.model
        page_size = m.page_size
        start_idx = req.start_send_idx
        transfer_input_len = len(req.origin_input_ids)
        end_idx = end_idx if end_idx is not None else min(req.extend_end, transfer_input_len)
        if not last_chunk:
            end_idx = end_idx - end_idx % page_size
        if end_idx < start_idx:
            return
        state_indices: Optional[List[Any]] = None
        if last_chunk:
            self.pools.meta.set_buf(req)
            if m.aux_kv_checksum:  # SGLang's KV checksum of what this rank sends
                self.pools.meta.set_kv_checksum(req, kv_checksum(self.pools.kv, req.pages))
            payloads = {
                StateType.MAMBA: lambda: [np.array(req.state["mamba"], np.int64)],
                StateType.SWA: lambda: np.array([req.state["swa"][p]
                                                 for p in self.swa_positions(req)], np.int64),
                StateType.DSA: lambda: np.array(req.pages, np.int64),
            }
            state_indices = [payloads[st]() if st in payloads else None
                             for st in self.kv_manager.kv_args.state_types]
        transfer_chunk_tokens = req.disagg_kv_sender.get_max_transfer_tokens()
        assert transfer_chunk_tokens is None
        segments = [(start_idx, end_idx)]
        for seg_start, seg_end in segments:
            is_final_segment = seg_end == end_idx
            token_rows = np.array([req.pages[t // page_size] * page_size + t % page_size
                                   for t in range(seg_start, seg_end)], np.int32)
            page_indices = kv_to_page_indices(token_rows, page_size)
            segment_is_last = last_chunk and is_final_segment
            if not req.disagg_kv_sender.should_send_kv_chunk(len(page_indices), segment_is_last):
                continue
            send_state_indices = state_indices if segment_is_last else None
            req.disagg_kv_sender.send(page_indices, send_state_indices,
                                      num_kv_tokens=seg_end - seg_start)
        req.start_send_idx = end_idx

    def process_disagg_prefill_inflight_queue(self) -> None:
        if not self.inflight_queue:
            return
        polls = poll_and_all_reduce_attn_cp_tp_group(
            [r.disagg_kv_sender for r in self.inflight_queue], None, self.tp_group)
        undone, done = [], []
        for req, poll in zip(self.inflight_queue, polls):
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                self.release_kv(req)
                req.disagg_kv_sender.clear()
                done.append((req, KVPoll.Success, "OK"))
            elif poll == KVPoll.Failed:
                message = self.handle_inflight_transfer_failure(req)
                done.append((req, KVPoll.Failed, message))
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for req {req.rid} in "
                                   "inflight queue")
        for req, state, message in done:
            metric = None
            if state == KVPoll.Success:
                kv_mgr = getattr(req.disagg_kv_sender, "kv_mgr", None)
                assert not getattr(kv_mgr, "is_dummy_cp_rank", False)
                metric = req.disagg_kv_sender.get_transfer_metric()
            self.finish(req, state, message, metric)
            self.maybe_release_metadata_buffer(req)
        self.inflight_queue = undone

    def handle_inflight_transfer_failure(self, req: Req) -> str:
        message = f"Prefill transfer failed for request rank={self.rank} {req.rid=}"
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as e:  # noqa: BLE001
            message += f" with exception {e}"
        self.release_kv(req)
        return message

    def idle(self) -> bool:
        return not (self.bootstrap_queue or self.waiting_queue or self.chunked_req
                    or self.inflight_queue)


class PrefillInstance(Instance):
    def __init__(self, model: Model, sa: SimpleNamespace, tp: int = 1, dp_rank: int = 0,
                 chunk: int = 8, seed: int = 1):
        super().__init__(tp)
        self.model, self.server_args, self.dp_rank = model, sa, dp_rank
        self.chunk, self.seed = chunk, seed
        self.scheds = [PrefillScheduler(self, r) for r in range(tp)]

    def abort_at_once(self, spec: Spec) -> bool:
        return spec.prefill_abort == "bootstrap"

    def close(self) -> None:
        for s in self.scheds:
            s.kv_manager.close()


# ------------------------------------------------------------------------------------ decode
@dataclasses.dataclass
class DecodeRequest:
    req: Req
    kv_receiver: Any
    waiting_for_input: bool = False
    metadata_buffer_index: int = -1


class DecodeScheduler:
    """One decode scheduler rank: DecodePreallocQueue + DecodeTransferQueue."""

    def __init__(self, inst: "DecodeInstance", rank: int):
        self.inst, self.rank = inst, rank
        m = inst.model
        self.model = m
        self.pools = Pools(m, inst.tp, rank, decode=True, seed=inst.seed + 500)
        sa = inst.server_args
        self.kv_args = make_kv_args(m, self.pools, engine_rank=rank % inst.tp, dp_rank=0,
                                    prefill=False)
        self.kv_manager = CLASSES["manager"](self.kv_args, DisaggregationMode.DECODE, sa, m.mla)
        self.gloo_group = RankGroup(inst.group, rank)
        self.allocator = ReqToMetadataIdxAllocator(m.aux_slots)
        self.free_pages = list(range(m.pool_pages))
        self.free_slots = {"mamba": list(range(m.mamba_slots)), "swa": list(range(m.swa_pages))}
        self.rng = random.Random(inst.seed * 17)  # the same on every rank: the same pages
        self.queue: List[DecodeRequest] = []
        self.pending_reqs: List[DecodeRequest] = []
        self.transfer_queue: List[DecodeRequest] = []
        self._ensure_retry_count: Dict[str, int] = {}
        self._ensure_last_attempt_time: Dict[str, float] = {}
        self.enable_deferred_kv_release = os.environ.get(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "") in ("1", "true", "True")
        self.deferred_kv_release_timeout = float(os.environ.get(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "30"))
        self._deferred_releases: List[Tuple[DecodeRequest, float, int, int]] = []

    # ---- DecodePreallocQueue
    def add(self, spec: Spec) -> None:
        req = Req(spec, self.inst.server_args.disaggregation_bootstrap_port)
        req.bootstrap_port = self.inst.bootstrap_port
        decode_req = DecodeRequest(req, CLASSES["receiver"](
            mgr=self.kv_manager, bootstrap_addr=self._addr(req),
            bootstrap_room=req.bootstrap_room))
        self.queue.append(decode_req)
        prefill_dp_rank = self._resolve_prefill_dp_rank(req)
        if prefill_dp_rank is not None:
            self._init_receiver(decode_req, prefill_dp_rank)
            return
        self.pending_reqs.append(decode_req)

    @staticmethod
    def _addr(req: Req) -> str:
        return f"{req.bootstrap_host}:{req.bootstrap_port}"

    def _resolve_prefill_dp_rank(self, req: Req) -> Optional[int]:
        prefill_info = self.kv_manager.prefill_info_table.get(self._addr(req))
        if prefill_info is None:
            return None
        if req.disagg_prefill_dp_rank is not None:
            return req.disagg_prefill_dp_rank
        if prefill_info.dp_size == 1:
            return 0
        if prefill_info.follow_bootstrap_room:
            return req.bootstrap_room % prefill_info.dp_size
        return None

    def _init_receiver(self, decode_req: DecodeRequest, prefill_dp_rank: int) -> None:
        decode_req.kv_receiver.init(prefill_dp_rank)

    def prefetch_prefill_dp_rank_queries(self) -> None:
        for decode_req in self.pending_reqs:
            if self.kv_manager.prefill_info_table.get(self._addr(decode_req.req)) is None:
                continue
            assert self._resolve_prefill_dp_rank(decode_req.req) is not None, \
                "SGLang would query the prefill DP rank over HTTP (query_prefill_dp_ranks)"

    def _ensure_prefill_info(self, addr_to_reqs: Dict[str, List[DecodeRequest]]):
        ready: Dict[str, List[DecodeRequest]] = {}
        remaining: List[DecodeRequest] = []
        now = time.monotonic()
        for addr, reqs in addr_to_reqs.items():
            last = self._ensure_last_attempt_time.get(addr)
            if last is not None and now - last < 1.0:
                remaining.extend(reqs)
                continue
            self._ensure_last_attempt_time[addr] = now
            if self.kv_manager.try_ensure_parallel_info(addr):
                self._ensure_retry_count.pop(addr, None)
                self._ensure_last_attempt_time.pop(addr, None)
                ready[addr] = reqs
                continue
            count = self._ensure_retry_count.get(addr, 0) + 1
            self._ensure_retry_count[addr] = count
            if count >= 15:
                for decode_req in reqs:
                    decode_req.kv_receiver.abort()
            else:
                remaining.extend(reqs)
        return ready, remaining

    def _resolve_pending_reqs(self) -> None:
        if not self.pending_reqs:
            return
        addr_to_reqs: Dict[str, List[DecodeRequest]] = {}
        for decode_req in self.pending_reqs:
            addr_to_reqs.setdefault(self._addr(decode_req.req), []).append(decode_req)
        ready, remaining = self._ensure_prefill_info(addr_to_reqs)
        resolved = []
        for reqs in ready.values():
            for decode_req in reqs:
                rank = self._resolve_prefill_dp_rank(decode_req.req)
                assert rank is not None, "SGLang would query the prefill DP rank over HTTP"
                resolved.append((decode_req, rank))
        self.pending_reqs = remaining
        for decode_req, rank in resolved:
            self._init_receiver(decode_req, rank)

    def _update_handshake_waiters(self) -> None:
        if not self.queue:
            return
        # As upstream (pp_size 1): once every request waits for input, only a receiver whose
        # conclude_state reads Failed makes the queue poll again.
        if all(d.waiting_for_input for d in self.queue) and not any(
                d.kv_receiver.conclude_state == KVPoll.Failed for d in self.queue):
            return
        polls = poll_and_all_reduce([d.kv_receiver for d in self.queue], self.gloo_group)
        for decode_req, poll in zip(self.queue, polls):
            if poll == KVPoll.Bootstrapping:
                pass
            elif poll == KVPoll.WaitingForInput:
                decode_req.waiting_for_input = True
            elif poll == KVPoll.Failed:
                message = f"Decode handshake failed for request rank={self.rank} " \
                          f"{decode_req.req.rid=}"
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:  # noqa: BLE001
                    message += f" with exception {e}"
                prepare_abort(decode_req.req, message)
            else:
                raise ValueError(f"Unexpected poll case: {poll}")

    def pop_preallocated(self) -> List[DecodeRequest]:
        self._resolve_pending_reqs()
        self._update_handshake_waiters()
        m = self.model
        failed, preallocated, remove = [], [], set()
        for i, decode_req in enumerate(self.queue):
            if isinstance(decode_req.req.finished_reason, FinishAbort):
                decode_req.kv_receiver.clear()
                self.finish(decode_req.req, KVPoll.Failed, decode_req.req.finished_reason.message)
                decode_req.kv_receiver = None
                failed.append(decode_req)
                remove.add(i)
        if failed:
            ids = {id(d) for d in failed}
            self.pending_reqs = [d for d in self.pending_reqs if id(d) not in ids]
        for i, decode_req in enumerate(self.queue):
            if i in remove or not decode_req.waiting_for_input:
                continue
            if self.allocator.available_size() <= 0:
                break
            req = decode_req.req
            input_len = len(req.origin_input_ids)
            need = kv_to_page_num(input_len, m.page_size)
            if len(self.free_pages) < need:
                break
            prefix_pages = req.spec.decode_prefix_pages
            total_prefix_len = prefix_pages * m.page_size
            req.pages = [self.free_pages.pop(self.rng.randrange(len(self.free_pages)))
                         for _ in range(need)]
            self.fill_prefix(req, prefix_pages)  # the radix cache holds these already
            if "mamba" in m.families:
                req.state["mamba"] = [self.free_slots["mamba"].pop(0)]
            if "swa" in m.families:
                req.state["swa"] = [self.free_slots["swa"].pop(
                    self.rng.randrange(len(self.free_slots["swa"]))) for _ in range(need)]
            token_rows = np.array([req.pages[t // m.page_size] * m.page_size + t % m.page_size
                                   for t in range(total_prefix_len, input_len)], np.int32)
            payloads = {
                StateType.MAMBA: lambda: [np.array(req.state["mamba"], np.int64)],
                StateType.SWA: lambda: np.array([req.state["swa"][p]
                                                 for p in self.swa_positions(req,
                                                                             total_prefix_len)],
                                                np.int64),
                StateType.DSA: lambda: np.array(req.pages, np.int64),
            }
            state_indices = [payloads[st]() if st in payloads else None
                             for st in self.kv_manager.kv_args.state_types]
            self._send_kv_metadata(decode_req, token_rows, state_indices,
                                   decode_prefix_len=total_prefix_len)
            preallocated.append(decode_req)
            remove.add(i)
        self.queue = [d for i, d in enumerate(self.queue) if i not in remove]
        return preallocated

    def swa_positions(self, req: Req, total_prefix_len: int) -> range:
        m = self.model
        seq_len = len(req.origin_input_ids)
        window_start = max(total_prefix_len, seq_len - m.swa_window)
        window_start = (window_start // m.page_size) * m.page_size
        return range(window_start // m.page_size, kv_to_page_num(seq_len, m.page_size))

    def fill_prefix(self, req: Req, prefix_pages: int) -> None:
        m, p = self.model, self.pools
        for b, buf in enumerate(p.kv):
            for pos in range(prefix_pages):
                buf[req.pages[pos]] = m.kv_page(req.bootstrap_room, b, pos, self.inst.tp,
                                                self.rank)
                p.shadow_kv[b][req.pages[pos]] = buf[req.pages[pos]]

    def _send_kv_metadata(self, decode_req: DecodeRequest, kv_indices: np.ndarray,
                          state_indices: List[Any], **metadata_kwargs: Any) -> None:
        decode_req.metadata_buffer_index = self.allocator.alloc()
        assert decode_req.metadata_buffer_index is not None
        page_indices = kv_to_page_indices(kv_indices, self.model.page_size).astype(np.int32)
        req = decode_req.req
        prefix_pages = metadata_kwargs["decode_prefix_len"] // self.model.page_size
        for page in req.pages[prefix_pages:]:
            self.pools.busy_pages[page] = req.bootstrap_room
        if "dsa" in self.model.families:  # full-sequence rows, the prefix's included
            for page in req.pages:
                self.pools.busy_rows[("dsa", page)] = req.bootstrap_room
        for name in ("mamba", "swa"):
            for row in req.state.get(name, []):
                self.pools.busy_rows[(name, row)] = req.bootstrap_room
        decode_req.kv_receiver.send_metadata(page_indices, decode_req.metadata_buffer_index,
                                             state_indices, **metadata_kwargs)

    # ---- DecodeTransferQueue
    def pop_transferred(self) -> None:
        if not self.transfer_queue:
            return
        polls = poll_and_all_reduce([d.kv_receiver for d in self.transfer_queue],
                                    self.gloo_group, decode_reqs=self.transfer_queue,
                                    metadata_buffers=self.pools.meta)
        remove, deferred = set(), set()
        for i, (decode_req, poll) in enumerate(zip(self.transfer_queue, polls)):
            req = decode_req.req
            if poll == KVPoll.Failed:
                message = f"Decode transfer failed for request rank={self.rank} {req.rid=}"
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:  # noqa: BLE001
                    message += f" with exception {e}"
                prepare_abort(req, message)
                # 3c69a4c7: only a decode-initiated abort (abort_notified) is held; the newer
                # decode.py @b7e89b39 also arms one for a failure (ensure_abort_notified).
                deferrable = (self.enable_deferred_kv_release
                              and decode_req.kv_receiver.kv_mgr.enable_deferred_decode_kv_release)
                if deferrable and self.model.newer_revision \
                        and not decode_req.kv_receiver.abort_notified:
                    decode_req.kv_receiver.ensure_abort_notified(force_arm=True)
                if deferrable and decode_req.kv_receiver.abort_notified:
                    self._defer_release(decode_req)
                    deferred.add(i)
                else:
                    self.release(req)
                    decode_req.kv_receiver.clear()
                    decode_req.kv_receiver = None
                self.finish(req, KVPoll.Failed, message)
                remove.add(i)
            elif poll == KVPoll.Success:
                self._commit_transfer_to_req(decode_req)
                remove.add(i)
                if isinstance(req.finished_reason, FinishAbort):
                    self.release(req)
                    self.finish(req, KVPoll.Failed, req.finished_reason.message)
                else:
                    self.verify(decode_req)
                    self.release(req)
                    self.finish(req, KVPoll.Success, "OK")
            elif poll in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                pass
            else:
                raise ValueError(f"Unexpected poll case: {poll}")
        for i in remove:
            if i in deferred:
                continue
            idx = self.transfer_queue[i].metadata_buffer_index
            self.pools.meta.bootstrap_room[idx] = 0
            self.allocator.free(idx)
        self.transfer_queue = [d for i, d in enumerate(self.transfer_queue) if i not in remove]
        self.pools.check_untouched("after pop_transferred")

    def _defer_release(self, decode_req: DecodeRequest) -> None:
        deadline = time.monotonic() + self.deferred_kv_release_timeout
        required_acks = len(decode_req.kv_receiver.bootstrap_infos)
        self._deferred_releases.append((decode_req, deadline, decode_req.metadata_buffer_index,
                                        required_acks))

    def resolve_deferred_releases(self) -> None:
        still, release = [], []
        now = time.monotonic()
        for decode_req, deadline, idx, acks in self._deferred_releases:
            kv_mgr = decode_req.kv_receiver.kv_mgr
            drained = kv_mgr.is_abort_release_safe(decode_req.req.bootstrap_room, acks)
            if not drained and now < deadline:
                still.append((decode_req, deadline, idx, acks))
            else:
                assert drained, "deferred release timed out before pdlib said the pages are safe"
                release.append((decode_req, idx))
        self._deferred_releases = still
        for decode_req, idx in release:
            self.release(decode_req.req)
            self.pools.meta.bootstrap_room[idx] = 0
            self.allocator.free(idx)
            decode_req.kv_receiver.kv_mgr.clear_deferred_abort_state(decode_req.req.bootstrap_room)
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None

    def _commit_transfer_to_req(self, decode_req: DecodeRequest) -> None:
        idx = decode_req.metadata_buffer_index
        buf = self.pools.meta.get_buf(idx)
        output_id, output_bootstrap_room = buf[0], buf[-1]
        actual_room = int(output_bootstrap_room[0])
        expected_room = decode_req.req.bootstrap_room
        if actual_room == 0:
            prepare_abort(decode_req.req, "Metadata unexpectedly not ready after readiness gate")
            decode_req.kv_receiver.clear()
            return
        if actual_room != expected_room:
            prepare_abort(decode_req.req, "Metadata corruption detected - bootstrap_room mismatch")
            decode_req.kv_receiver.clear()
            return
        if self.model.aux_kv_checksum:  # SGLang's own check of what arrived
            sent = self.pools.meta.get_kv_checksum(idx)
            if sent != kv_checksum(self.pools.kv, decode_req.req.pages):
                prepare_abort(decode_req.req, f"KV checksum mismatch (prefill sent {sent})")
                decode_req.kv_receiver.clear()
                return
        decode_req.req.output_ids.append(int(output_id[0]))
        decode_req.kv_receiver.clear()

    def verify(self, decode_req: DecodeRequest) -> None:
        """Every byte this rank received, then the shadow gets the verified content."""
        req, m, p = decode_req.req, self.model, self.pools
        room, tp, r = req.bootstrap_room, self.inst.tp, self.rank
        for b, buf in enumerate(p.kv):
            for pos, page in enumerate(req.pages):
                want = m.kv_page(room, b, pos, tp, r)
                assert np.array_equal(buf[page], want), \
                    f"room {room}: rank {r} kv buffer {b} page position {pos} (page {page}) " \
                    f"differs{' (decode prefix)' if pos < req.spec.decode_prefix_pages else ''}"
                p.shadow_kv[b][page] = buf[page]
        if "mamba" in m.families:
            for b, buf in enumerate(p.state["mamba"]):
                row = req.state["mamba"][0]
                assert np.array_equal(buf[row], m.mamba_row(room, b, tp, r)), \
                    f"room {room}: rank {r} mamba buffer {b} differs"
                p.shadow_state["mamba"][b][row] = buf[row]
        if "swa" in m.families:
            prefix = req.spec.decode_prefix_pages * m.page_size
            window = self.swa_positions(req, prefix)
            for pos in window:
                row = req.state["swa"][pos]
                assert np.array_equal(p.state["swa"][0][row], m.swa_page(room, 0, pos, tp, r)), \
                    f"room {room}: rank {r} swa page position {pos} differs"
                p.shadow_state["swa"][0][row] = p.state["swa"][0][row]
        if "dsa" in m.families:
            for pos, page in enumerate(req.pages):
                assert np.array_equal(p.state["dsa"][0][page], m.dsa_row(room, pos)), \
                    f"room {room}: rank {r} dsa row of position {pos} differs"
                p.shadow_state["dsa"][0][page] = p.state["dsa"][0][page]
        meta, idx = p.meta, decode_req.metadata_buffer_index
        assert req.output_ids[-1] == first_token(room), f"room {room}: output id"
        assert int(meta.output_topk_index[idx, 0]) == room
        assert np.all(meta.output_hidden_states[idx] == room % 251)
        if meta.output_dsa_topk_indices is not None:
            assert np.all(meta.output_dsa_topk_indices[idx] == room % 83)
        if meta.enable_sampling_mask:
            assert np.all(meta.output_token_sampling_mask_idx[idx] == room % 89)

    def release(self, req: Req) -> None:
        """release_kv_cache: pages and rows go to the next request at once (new bytes)."""
        p = self.pools
        rows = {k: v for k, v in req.state.items()}
        for page in req.pages:
            p.busy_pages.pop(page, None)
            p.busy_rows.pop(("dsa", page), None)
        for name, indices in rows.items():
            for row in indices:
                p.busy_rows.pop((name, row), None)
        if "dsa" in self.model.families:
            rows["dsa"] = list(req.pages)
        p.reuse(req.pages, rows)
        self.free_pages.extend(req.pages)
        for name in ("mamba", "swa"):
            self.free_slots[name].extend(req.state.get(name, []))
        req.pages, req.state = [], {}

    def finish(self, req: Req, state: int, reason: str) -> None:
        with self.inst._lock:
            self.inst.reasons.setdefault(req.bootstrap_room, []).append(reason)
        if self.rank == 0:
            self.inst.results[req.bootstrap_room] = (state, reason)
            if req.spec.decode_abort == "transfer" and req.spec.hold is not None:
                req.spec.hold.set()

    def due_aborts(self) -> List[str]:
        out = []
        for d in self.transfer_queue:
            if d.req.spec.decode_abort == "transfer" and not d.req.to_abort:
                d.req.to_abort = True
                out.append(d.req.rid)
        return out

    def abort_request(self, rid: str) -> None:
        """Scheduler.abort_request (decode branch)."""
        for decode_req in self.queue:
            if decode_req.req.rid == rid:
                decode_req.kv_receiver.abort()
        for decode_req in self.transfer_queue:
            if decode_req.req.rid == rid:
                receiver = decode_req.kv_receiver
                receiver.abort()
                if receiver.kv_mgr.enable_deferred_decode_kv_release and receiver.abort_notified:
                    receiver.kv_mgr.register_deferred_abort_room(decode_req.req.bootstrap_room)
                if decode_req.req.spec.hold is not None:
                    decode_req.req.spec.hold.set()  # let prefill go on: it must see Failed

    def step(self) -> None:
        """event_loop_normal_disagg_decode: prefetch, then process_decode_queue."""
        self.prefetch_prefill_dp_rank_queries()
        self.transfer_queue.extend(self.pop_preallocated())
        self.pop_transferred()
        if self.enable_deferred_kv_release:
            self.resolve_deferred_releases()

    def idle(self) -> bool:
        return not (self.queue or self.transfer_queue or self._deferred_releases)


class DecodeInstance(Instance):
    def __init__(self, model: Model, sa: SimpleNamespace, bootstrap_port: int, tp: int = 1,
                 seed: int = 1):
        super().__init__(tp)
        self.model, self.server_args, self.seed = model, sa, seed
        self.bootstrap_port = bootstrap_port
        self.scheds = [DecodeScheduler(self, r) for r in range(tp)]

    def abort_at_once(self, spec: Spec) -> bool:
        return spec.decode_abort == "prealloc"

    def close(self) -> None:
        for s in self.scheds:
            s.kv_manager.close()

    def final_check(self) -> None:
        for s in self.scheds:
            assert s.idle(), f"decode rank {s.rank} not idle"
            s.pools.check_untouched("at the end")
            free = list(s.allocator.free_slots)
            assert not np.any(s.pools.meta.bootstrap_room[free, 0]), "a free metadata slot " \
                "holds a bootstrap_room: a late aux write"
