"""pdlib as an SGLang disaggregation transfer backend.

The classes here are what SGLang's schedulers call on a transfer backend (upstream sgl-
project/sglang main at 3c69a4c7, 2026-08-22: disaggregation/prefill.py, decode.py, base/conn.py,
common/conn.py, utils.py; and what the newer, undated prefill.py @423bf210 / decode.py @b7e89b39
add, python/README.md "SGLang"): KVManager, KVSender, KVReceiver, KVBootstrapServer, KVPoll, and
a KVArgs of the same shape as SGLang's own (base.KVArgs: annotations only, every attribute set
by SGLang's scheduler). python/README.md ("SGLang") has the call-by-call conformance table, the
plugin that selects the backend without patching SGLang (pdlib.sglang_plugin, entry point group
`sglang.srt.plugins`) and the two-line patch for older SGLang.

How the shapes are bridged:
  * SGLang's KVArgs and server_args are translated by name (pdlib._sglang_args); the per-rank
    KV head count comes from the model's config.json, the same on both sides, since SGLang's
    decode sets no head counts. pdlib's own knobs come from PDLIB_SGLANG_* variables.
  * SGLang never says which send() is the last: the sender counts pages against init().
  * SGLang's send()/init()/send_metadata() do not raise on a transfer error: a pdlib error fails
    the request with the reason, poll() turns Failed, failure_exception() raises it.
  * SGLang frees a request's pages as soon as its all-reduced poll() says Failed and never asks
    pages_reusable(): poll() does not report Failed until pdlib says the pages are safe (until
    then it reports Transferring, or Bootstrapping before anything was handed over). A rank that
    learns of the failure from another rank (the MIN all-reduce) aborts its own request in
    failure_exception(), and clear() waits for its pages (bounded), or SGLang's deferred-release
    hooks (enable_deferred_decode_kv_release) hold them without blocking.
  * The prefill DP rank: pdlib finds it itself (room % prefill dp_size, or the router's rank),
    so prefill_info_table answers at once and SGLang's HTTP query path is never taken.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import numbers
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import numpy.typing as npt

import pdlib
from pdlib import KVPoll  # SGLang compares poll() results with KVPoll.Success etc.
from pdlib import _sglang_args
from pdlib._sglang_args import ConfigError, state_lists

__all__ = [
    "KVArgs",
    "KVPoll",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "KVBootstrapServer",
    "KVTransferError",
    "KVTransferMetric",
    "DisaggregationMode",
    "PrefillInfo",
    "ConfigError",
]

logger = logging.getLogger("pdlib.sglang")

ABORT_REASON = "aborted by the SGLang scheduler"


class DisaggregationMode:
    """The values of SGLang's DisaggregationMode (an enum whose .value is one of these)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVArgs:
    """SGLang's KVArgs (base/conn.py): annotations only; SGLang's scheduler sets what it has.

    pdlib.sglang reads every attribute with getattr and a default, so SGLang's own KVArgs class
    works just as well (the plugin hands SGLang its own). Nothing pdlib-specific is needed."""

    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    kv_layer_ids: List[int]
    kv_cache_dtype_str: str
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[Any]
    state_data_ptrs: List[List[int]]
    state_data_lens: List[List[int]]
    state_item_lens: List[List[int]]
    state_layer_ids: List[List[int]]
    state_dim_per_tensor: List[List[int]]
    state_slice_outer_counts: List[List[int]]
    is_hybrid_mla_backend: bool
    state_conv_shard_groups: List[List[Optional[List[int]]]]
    ib_device: str
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    system_dp_rank: int
    pp_rank: int
    prefill_start_layer: int
    prefill_end_layer: Optional[int]
    mla_compression_ratios: Optional[List[int]]
    kv_buf_groups: int
    total_kv_layers: int
    # base/conn.py @ccd10042 (newer than main 3c69a4c7) adds these two
    rust_http_port: Optional[int]
    num_draft_entries: int = 0


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's KVTransferMetric (base/conn.py), filled from what pdlib saw of the request."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class _RoomAsDPRank(int):
    """What SGLang's decode computes as `bootstrap_room % prefill_info.dp_size` with pdlib's
    PrefillInfo: the room itself, marked. KVReceiver.init() turns it into "pdlib's default",
    room % the prefill deployment's real DP size, which pdlib learns from the bootstrap server."""


class _PrefillDPSize(int):
    """PrefillInfo.dp_size: not 1 (so SGLang does not force rank 0), larger than any room (so
    room % dp_size is the room), and `room % dp_size` yields a _RoomAsDPRank."""

    def __new__(cls) -> "_PrefillDPSize":
        return super().__new__(cls, (1 << 63) - 1)  # rooms are below 2**63 - 1; fits int64

    def __rmod__(self, other: Any) -> Any:
        return _RoomAsDPRank(other) if isinstance(other, int) else NotImplemented

    def __repr__(self) -> str:
        return "PrefillDPSize(resolved by pdlib)"


@dataclasses.dataclass
class PrefillInfo:
    """What SGLang's decode reads from KVManager.prefill_info_table.get(bootstrap_addr)
    (decode.py `_resolve_prefill_dp_rank`): with follow_bootstrap_room and this dp_size SGLang
    hands the room to KVReceiver.init(), and pdlib resolves the prefill DP rank."""

    dp_size: int = dataclasses.field(default_factory=_PrefillDPSize)
    follow_bootstrap_room: bool = True


class _PrefillInfoTable:
    """KVManager.prefill_info_table: every bootstrap address is known at once (pdlib looks the
    deployment up itself when a receiver is created, and fails the room with the reason)."""

    def __init__(self) -> None:
        self._info = PrefillInfo()

    def get(self, bootstrap_addr: Any, default: Any = None) -> PrefillInfo:
        return self._info

    def __getitem__(self, bootstrap_addr: Any) -> PrefillInfo:
        return self._info

    def __contains__(self, bootstrap_addr: Any) -> bool:
        return True


class KVTransferError(pdlib.Error):
    """What failure_exception() raises: the room and pdlib's reason, intact.
    is_from_another_rank: this rank's transfer had not failed, another TP rank's had (SGLang
    logs those at debug level)."""

    def __init__(self, bootstrap_room: int, failure_reason: str,
                 cause: Optional[pdlib.Error] = None, is_from_another_rank: bool = False):
        super().__init__(f"KVTransferError(bootstrap_room={bootstrap_room}): {failure_reason}",
                         int(cause.code) if cause is not None else None,
                         cause.reason if cause is not None else failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank


def _mode_name(mode: Any) -> str:
    value = getattr(mode, "value", mode)
    if isinstance(value, pdlib.Mode):
        return "prefill" if value == pdlib.Mode.Prefill else "decode"
    return str(value).lower()


class KVManager:
    """KVManager(kv_args, disaggregation_mode, server_args, is_mla_backend): one per scheduler
    rank, built by SGLang's PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager with its
    own KVArgs. A prefill manager registers with the bootstrap server here, as SGLang's
    CommonKVManager does in its constructor. Settings SGLang cannot be served with raise a
    ValueError (ConfigError) that says what to do."""

    # Read by SGLang on the class or with hasattr/getattr: their safe values.
    supports_decode_kv_broadcast = False
    supports_host_destination = False
    supports_role_switch = False
    is_dummy_cp_rank = False
    enable_all_cp_ranks_for_transfer = False
    enable_deferred_decode_kv_release = False

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False, **_: Any):
        self.kv_args = args
        self.args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        mode = _mode_name(disaggregation_mode)
        if mode not in ("prefill", "decode"):
            raise ValueError(f"pdlib.sglang.KVManager: unsupported mode {disaggregation_mode!r}")
        try:
            self.options, self.layout = _sglang_args.build(args, mode, server_args,
                                                           self.is_mla_backend)
        except ConfigError as e:
            raise ConfigError(f"pdlib.sglang ({mode}): {e}") from None
        for note in self.layout.notes:
            logger.warning("pdlib.sglang (%s): %s", mode, note)
        self.manager = pdlib.KVManager.create(self.options)
        self.mode = mode
        self.bootstrap_port = self.options.bootstrap_port
        self.attn_tp_size = self.layout.attn_tp_size
        self.attn_tp_rank = self.layout.tp_rank
        self.dp_size = self.layout.dp_size
        self.pp_size = self.options.args.parallel.pp_size
        self.prefill_info_table = _PrefillInfoTable()
        # Decode: SGLang's deferred-release hooks are answered with pdlib's page-reuse rule;
        # they take effect when SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is set.
        self.enable_deferred_decode_kv_release = mode == "decode"
        self.release_wait = _sglang_args.env_float("PDLIB_SGLANG_RELEASE_WAIT", 30.0)
        self._receivers: Dict[int, "KVReceiver"] = {}
        self._deferred: Dict[int, int] = {}
        self._generation = 0
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._retired: List[Any] = []  # (deadline, handle, abort once bound)
        self._retired_lock = threading.Lock()
        self._reaper: Optional[threading.Thread] = None
        self._closing = threading.Event()

    def _create_sender(self, room: int) -> Any:
        self._reap(room)
        return self.manager.create_sender(room)

    def _retire(self, handle: Any, abort_when_bound: bool = False) -> None:
        """A handle SGLang dropped, kept for up to the bootstrap timeout so that the peer learns
        the request failed: a failed sender answers a decode rank that binds late; a receiver
        aborted before it was bound is aborted once bound (pdlib tells only bound peers). A
        daemon thread looks after them every 20 ms."""
        if handle.closed:
            return
        deadline = time.monotonic() + self.options.bootstrap_timeout
        with self._retired_lock:
            self._retired.append((deadline, handle, abort_when_bound))
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap_loop, daemon=True,
                                                name="pdlib-sglang-reaper")
                self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._closing.wait(0.02):
            try:
                self._reap()
            except pdlib.Error:  # the manager was closed under us (interpreter exit)
                return

    def _reap(self, room: Optional[int] = None) -> None:
        now = time.monotonic()
        with self._retired_lock:
            keep = []
            for deadline, handle, abort_when_bound in self._retired:
                if handle.closed:
                    continue
                if abort_when_bound:
                    if handle.poll() != KVPoll.Bootstrapping or deadline <= now:
                        handle.abort(ABORT_REASON)
                        handle.close()
                        continue
                if deadline <= now or handle.room == room:
                    handle.close()
                else:
                    keep.append((deadline, handle, abort_when_bound))
            self._retired = keep

    def register_to_bootstrap(self) -> None:
        """pdlib registered this prefill rank when the manager was created."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking; always True: pdlib resolves the prefill deployment per request."""
        return True

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pdlib-sglang")
        return self._executor

    def submit_prefill_recompute(self, kv_receiver: "KVReceiver", payload: Any = None) -> None:
        """PD retraction (rebootstrap) asks the prefill to recompute over HTTP; pdlib.sglang
        does not: the request fails with the reason."""
        kv_receiver._fail_reason("PD retraction rebootstrap (prefill recompute) is not "
                                 "supported by pdlib.sglang")

    # ---- SGLang's deferred decode KV release (decode.py DecodeTransferQueue._defer_release)
    def register_deferred_abort_room(self, room: int, *_: Any, **__: Any) -> int:
        """main @3c69a4c7 (2026-08-22): (room). Newer undated revisions add a generation or a
        token and the expected ranks, positional or keyword: taken and ignored, since pdlib's
        page-reuse rule (is_abort_release_safe) needs neither. Returns a generation (truthy, for
        the revisions that check the result)."""
        self._generation += 1
        self._deferred[int(room)] = self._generation
        return self._generation

    def note_abort_ack(self, room: int, *_: Any, **__: Any) -> bool:
        """Newer revisions' ack bookkeeping: pdlib counts the drains itself."""
        return True

    def is_abort_release_safe(self, room: int, required_acks: int = 0, *_: Any) -> bool:
        """True once pdlib says no write for the room can land in its pages any more."""
        receiver = self._receivers.get(int(room))
        return receiver is None or receiver.pages_reusable()

    def clear_deferred_abort_state(self, room: int, *_: Any) -> None:
        self._deferred.pop(int(room), None)

    def metrics(self) -> Dict[str, Any]:
        return self.manager.metrics()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._closing.set()
        if self._reaper is not None:
            self._reaper.join()
        with self._retired_lock:
            for _, handle, _ in self._retired:
                handle.close()
            self._retired = []
        self.manager.close()


def _indices(values: Any, what: str) -> npt.NDArray[np.int32]:
    """int32, contiguous, range-checked: what pdlib takes without another copy."""
    if isinstance(values, np.ndarray) and values.dtype == np.int32 and values.ndim == 1 \
            and values.flags["C_CONTIGUOUS"]:
        return values
    if values is None:
        return np.zeros(0, np.int32)
    if hasattr(values, "cpu") and hasattr(values, "numpy"):  # a torch tensor
        values = values.cpu().numpy()
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, np.int32)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected integers, got dtype {array.dtype}")
    if array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max:
        raise pdlib.OutOfRangeError(f"OUT_OF_RANGE: {what}: index does not fit int32",
                                    int(pdlib.StatusCode.OutOfRange),
                                    f"{what}: index does not fit int32")
    return np.ascontiguousarray(array.reshape(-1), dtype=np.int32)


class _Handle:
    """What SGLang's sender and receiver share: poll, failure_exception, abort, clear.

    poll() reports pdlib's state, except that Failed waits for pdlib's page-reuse rule: until
    pages_reusable() it reads Transferring (pages handed over) or Bootstrapping (none yet),
    which every SGLang queue accepts, so SGLang never frees pages a late write could reach."""

    handle: Any = None
    bootstrap_room: int = 0
    _handed_over = False  # init()/send_metadata() handed pages to pdlib
    _seen: Optional[KVPoll] = None
    _t_waiting: Optional[float] = None
    _t_done: Optional[float] = None
    _error: Optional[KVTransferError] = None

    def poll(self) -> KVPoll:
        h = self.handle
        if h is None:
            return KVPoll.Failed if self._error is not None else KVPoll.Bootstrapping
        state: KVPoll = h.poll()
        if state is not self._seen:
            self._observe(state)
        if state or self._safe(h):  # KVPoll.Failed is 0
            return state
        return KVPoll.Transferring if self._handed_over else KVPoll.Bootstrapping

    def _observe(self, state: KVPoll) -> None:
        self._seen = state
        if state >= KVPoll.WaitingForInput and self._t_waiting is None:
            self._t_waiting = time.monotonic()
        if state == KVPoll.Success and self._t_done is None:
            self._t_done = time.monotonic()

    def _h(self) -> Any:
        return self.handle

    def pages_reusable(self) -> bool:
        """pdlib's page-reuse rule: no write for this request can reach its pages any more."""
        h = self._h()
        return True if h is None else self._safe(h)

    def _safe(self, h: Any) -> bool:
        return bool(h.pages_reusable())

    def _raise_failure(self) -> None:
        if self._error is None:
            h = self._h()
            reason = h.failure_reason() if h is not None else None
            from_other = False
            if reason is None:
                # The all-reduced poll failed on another rank while this one is still live (or
                # even done): stop this rank's transfer too, and say where the failure was.
                state = h.poll() if h is not None else KVPoll.Failed
                if h is not None and not state.is_terminal:
                    h.abort("failed on another TP rank of the request")
                reason = pdlib.AbortedError(
                    "ABORTED: the request failed on another TP rank (this rank's state: "
                    f"{state.name})", int(pdlib.StatusCode.Aborted),
                    f"the request failed on another TP rank (this rank's state: {state.name})")
                from_other = True
            text = str(reason)
            mgr = getattr(self, "kv_mgr", None)
            if mgr is not None and mgr.layout.kv_pages == "whole" and "kv_head_num" in text:
                text += (" [pdlib.sglang: this side moves KV pages whole: "
                         f"{mgr.layout.why_whole}; give both sides the model config "
                         "(server_args.model_path with config.json) or "
                         "PDLIB_SGLANG_TOTAL_KV_HEADS]")
            self._error = KVTransferError(self.bootstrap_room, text, reason, from_other)
        raise self._error

    def _fail(self, error: pdlib.Error) -> None:
        # SGLang does not expect send()/init() to raise: fail the request with the reason.
        h = self._h()
        if h is not None:
            h.abort(str(error))
        elif self._error is None:
            self._error = KVTransferError(self.bootstrap_room, str(error), error)

    def _fail_reason(self, reason: str) -> None:
        self._fail(pdlib.FailedPreconditionError(f"FAILED_PRECONDITION: {reason}",
                                                 int(pdlib.StatusCode.FailedPrecondition),
                                                 reason))


class KVSender(_Handle):
    """KVSender(mgr=, bootstrap_addr=, bootstrap_room=, dest_tp_ranks=, pp_rank=,
    req_has_disagg_prefill_dp_rank=): prefill, one per request and rank
    (prefill.py PrefillBootstrapQueue.create_sender)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Optional[List[int]] = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False, *_: Any, **__: Any):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.curr_idx = 0
        self._t_created = time.monotonic()
        self._t_first_send: Optional[float] = None
        self._bytes = 0
        self._metric: Optional[KVTransferMetric] = None
        try:
            self.handle = mgr._create_sender(self.bootstrap_room)
        except pdlib.Error as e:
            self.handle = None
            self._error = KVTransferError(self.bootstrap_room, str(e), e)
            return
        layout = mgr.layout
        if layout.dp_size > 1 and not req_has_disagg_prefill_dp_rank \
                and self.bootstrap_room % layout.dp_size != layout.dp_rank:
            self._fail_reason(
                f"room {self.bootstrap_room} reached prefill DP rank {layout.dp_rank}, but "
                f"decode looks for it on DP rank {self.bootstrap_room % layout.dp_size} (room % "
                f"dp_size {layout.dp_size}): route with --load-balance-method "
                "follow_bootstrap_room, or give the request a disagg_prefill_dp_rank")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        """num_kv_indices: the pages after decode's prefix (SGLang's kv_to_page_num)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        if self.handle is None:
            return
        self._handed_over = True
        try:
            self.handle.init(self.num_kv_indices, self.aux_index)
        except pdlib.Error as e:
            self._fail(e)

    def pop_decode_prefix_len(self) -> int:
        """The tokens decode already holds (known once poll() reached WaitingForInput), else 0."""
        h = self.handle
        if h is None:
            return 0
        value = h.decode_prefix_len
        return 0 if value is None else int(value)

    def get_max_transfer_tokens(self) -> Optional[int]:
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # An empty last chunk still carries the aux slot and the state (a whole-prompt prefix).
        return num_pages > 0 or bool(last_chunk)

    def mark_prefill_complete(self) -> None:
        raise NotImplementedError("pdlib.sglang supports the 'early' decode allocation policy "
                                  "only")

    def send(self, kv_indices: Any, state_indices: Any = None, *args: Any,
             num_kv_tokens: Optional[int] = None, token_position_offset: Optional[int] = None,
             **_: Any) -> None:
        """One chunk (segment) of pages, in prompt order after decode's prefix. The third
        argument, num_kv_tokens (main) or token_position_offset (other branches), positional
        or keyword, is informational: pdlib maps pages by their order."""
        event = self.__dict__.pop("_early_send_wait_event", None)
        if event is not None:
            # prefill.py maybe_send_cached_prefix_chunk: the previous forward may still be
            # writing these pages on the forward stream.
            event.synchronize()
        h = self.handle
        if h is None:
            return
        try:
            self._send(h, kv_indices, state_indices)
        except (pdlib.Error, TypeError, ValueError) as e:
            self._fail(e if isinstance(e, pdlib.Error) else pdlib.InvalidArgumentError(
                f"INVALID_ARGUMENT: {e}", int(pdlib.StatusCode.InvalidArgument), str(e)))

    def _send(self, h: Any, kv_indices: Any, state_indices: Any) -> None:
        pages = _indices(kv_indices, "kv_indices")
        self.curr_idx += len(pages)
        total = self.num_kv_indices
        is_last = total is not None and self.curr_idx >= total
        if total is not None and self.curr_idx > total:
            raise ValueError(f"room {self.bootstrap_room}: {self.curr_idx} pages sent, init() "
                             f"announced {total}")
        entries = state_indices if isinstance(state_indices, (list, tuple)) else [state_indices]
        if not is_last and any(v is not None for v in entries):
            raise ValueError(f"room {self.bootstrap_room}: state indices with a chunk that is "
                             f"not the last ({self.curr_idx} of {total} pages)")
        if self._t_first_send is None:
            self._t_first_send = time.monotonic()
        layout = self.kv_mgr.layout
        states = state_lists(state_indices, layout.families) if is_last else None
        h.send(pages, is_last, states)
        self._bytes += len(pages) * layout.kv_page_bytes
        if is_last:
            if self.aux_index is not None:
                self._bytes += layout.aux_row_bytes
            for f, indices in enumerate(states or []):
                self._bytes += len(indices or []) * layout.state_item_bytes[f]

    def failure_exception(self) -> None:
        """Raises the failure. SGLang calls no clear() after a failed send: the manager keeps
        the failed room for the bootstrap timeout (so that a decode rank that binds to it late
        is told it failed instead of waiting) and releases it then."""
        try:
            self._raise_failure()
        finally:
            if self.handle is not None:
                self.kv_mgr._retire(self.handle)

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.abort(ABORT_REASON)
        elif self._error is None:
            self._fail_reason(ABORT_REASON)

    def _transfer_metric(self) -> KVTransferMetric:
        done = self._t_done
        return KVTransferMetric(
            transfer_latency_s=None if done is None or self._t_first_send is None
            else max(0.0, done - self._t_first_send),
            alloc_latency_s=None if self._t_waiting is None
            else max(0.0, self._t_waiting - self._t_created),
            transfer_total_bytes=self._bytes)

    def get_transfer_metric(self) -> KVTransferMetric:
        """Also after clear() (SGLang reads it then)."""
        return self._metric if self._metric is not None else self._transfer_metric()

    def clear(self) -> None:
        """After Success (SGLang's inflight queue): the room is released."""
        if self.handle is not None and not self.handle.closed:
            self.poll()  # note Success's time if this is the first to see it
            self._metric = self._transfer_metric()
            self.handle.close()


class KVReceiver(_Handle):
    """KVReceiver(mgr=, bootstrap_addr=, bootstrap_room=): decode, one per request and rank
    (decode.py DecodePreallocQueue._create_receiver_and_enqueue). pdlib's receiver is created in
    init(prefill_dp_rank); send_metadata() hands over the pages.

    The older shapes work too: a 4th argument prefill_dp_rank, and init(kv_indices, aux_index,
    state_indices) for init + send_metadata in one call."""

    require_staging = False
    supports_host_destination = False

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, *_: Any, **__: Any):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.prefill_dp_rank = prefill_dp_rank
        self._handle: Any = None
        self._created = False
        self.abort_notified = False
        self.bootstrap_infos: List[str] = []
        self.init_time: Optional[float] = None
        self._abort_when_bound = False
        mgr._receivers[self.bootstrap_room] = self

    @property
    def handle(self) -> Any:
        """pdlib's receiver (created with the prefill DP rank known so far, if not yet)."""
        return self._ensure_handle()

    @handle.setter
    def handle(self, value: Any) -> None:
        self._handle = value
        self._created = True

    def _ensure_handle(self) -> Any:
        if not self._created:
            self._created = True
            if self._error is None:
                try:
                    self._handle = self.kv_mgr.manager.create_receiver(
                        self.bootstrap_addr, self.bootstrap_room, self.prefill_dp_rank)
                    self.bootstrap_infos = [self.bootstrap_addr]
                except pdlib.Error as e:
                    self._error = KVTransferError(self.bootstrap_room, str(e), e)
        return self._handle

    @property
    def conclude_state(self) -> Optional[KVPoll]:
        state = self.poll() if self._created else None
        return state if state is not None and state.is_terminal else None

    def poll(self) -> KVPoll:
        h = self._handle
        if h is None or self._abort_when_bound:
            return KVPoll.Failed if self._error is not None else KVPoll.Bootstrapping
        state: KVPoll = h.poll()
        if state is not self._seen:
            self._observe(state)
        if state or self._safe(h):
            return state
        return KVPoll.Transferring if self._handed_over else KVPoll.Bootstrapping

    def _h(self) -> Any:
        return self._handle

    def _fail(self, error: pdlib.Error) -> None:
        self._created = True  # after a failure no receiver is created any more
        super()._fail(error)

    def init(self, prefill_dp_rank: Any = None, aux_index: Optional[int] = None,
             state_indices: Any = None, *_: Any, **kwargs: Any) -> None:
        """init(prefill_dp_rank): creates pdlib's receiver, with the router's DP rank, or with
        pdlib's own choice when SGLang derived the rank from pdlib's PrefillInfo (the room)."""
        if prefill_dp_rank is None or (isinstance(prefill_dp_rank, numbers.Real)
                                       and not isinstance(prefill_dp_rank, bool)):
            rank = prefill_dp_rank
            if isinstance(rank, (_RoomAsDPRank, float)) or (
                    rank is not None and int(rank) == self.bootstrap_room):
                rank = None  # derived from pdlib's PrefillInfo: pdlib picks the DP rank
            if not self._created:
                self.prefill_dp_rank = None if rank is None else int(rank)
            self._ensure_handle()
            return
        self._ensure_handle()  # the older init(kv_indices, aux_index, state_indices)
        self.send_metadata(prefill_dp_rank, aux_index, state_indices, **kwargs)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Any = None, decode_prefix_len: Optional[int] = None,
                      *_: Any, destination: Any = None, device_kv_indices: Any = None,
                      **__: Any) -> None:
        """Hands over the pages of tokens [decode_prefix_len, prompt end), the metadata slot and
        the state indices (one entry per KVArgs.state_types component)."""
        h = self._ensure_handle()
        if h is None:
            return
        where = str(getattr(destination, "value", destination) or "").lower()
        if where not in ("", "device", "gpu"):
            self._fail_reason(f"KV destination {where!r}: pdlib.sglang receives into the device "
                              "pools only (supports_host_destination is False)")
            return
        if device_kv_indices is not None:
            self._fail_reason("device_kv_indices (DSV4 HiSparse) are not supported")
            return
        try:
            pages = _indices(kv_indices, "kv_indices")
            states = state_lists(state_indices, self.kv_mgr.layout.families)
            h.init(pages, aux_index, states, decode_prefix_len=int(decode_prefix_len or 0))
        except (pdlib.Error, TypeError, ValueError) as e:
            self._fail(e if isinstance(e, pdlib.Error) else pdlib.InvalidArgumentError(
                f"INVALID_ARGUMENT: {e}", int(pdlib.StatusCode.InvalidArgument), str(e)))
            return
        self._handed_over = True
        self.init_time = time.monotonic()

    def failure_exception(self) -> None:
        self._raise_failure()

    def abort(self) -> None:
        h = self._handle
        if h is not None and not self._handed_over and h.poll() == KVPoll.Bootstrapping:
            # Not bound to prefill yet: pdlib would not tell prefill, which would then wait its
            # bootstrap timeout. The request fails here now; pdlib's receiver is aborted once
            # bound (clear() hands it to the manager for that).
            if self._error is None:
                reason = pdlib.AbortedError(f"ABORTED: {ABORT_REASON}",
                                            int(pdlib.StatusCode.Aborted), ABORT_REASON)
                self._error = KVTransferError(self.bootstrap_room, str(reason), reason)
            self._abort_when_bound = True
        elif h is not None:
            h.abort(ABORT_REASON)
            self.abort_notified = self._handed_over
        elif self._error is None:
            self._fail_reason(ABORT_REASON)

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """SGLang's deferred release (decode.py pop_transferred): make sure prefill was told.
        abort_notified is True when pages were handed over (then is_abort_release_safe waits
        for pdlib's page-reuse rule)."""
        h = self._handle
        if h is not None and not self._abort_when_bound and not h.poll().is_terminal:
            h.abort("failed on another TP rank of the request")
        self.abort_notified = self._handed_over

    def clear(self) -> None:
        """Releases the room. SGLang reuses the pages right after: if a write could still reach
        them (another TP rank failed while this one was live), abort and wait for pdlib's
        page-reuse rule, at most PDLIB_SGLANG_RELEASE_WAIT seconds."""
        h = self._handle
        if self.kv_mgr._receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr._receivers[self.bootstrap_room]
        if h is None or h.closed:
            return
        if self._abort_when_bound:
            self.kv_mgr._retire(h, abort_when_bound=True)
            return
        if not self._safe(h):
            if not h.poll().is_terminal:
                h.abort("released by the SGLang scheduler")
            deadline = time.monotonic() + self.kv_mgr.release_wait
            while not self._safe(h) and time.monotonic() < deadline:
                time.sleep(0.001)
            if not self._safe(h):
                logger.error("pdlib.sglang: room %d released after %.0f s while a prefill rank "
                             "could still write its pages (set "
                             "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 to hold them "
                             "without blocking)", self.bootstrap_room, self.kv_mgr.release_wait)
        h.close()


class KVBootstrapServer:
    """KVBootstrapServer(host=, port=): the bootstrap server of one prefill deployment, started
    by SGLang's prefill (managers/disagg_service.start_disagg_service). pdlib's is gRPC; SGLang
    never talks to it over HTTP with this backend."""

    def __init__(self, host: str = "0.0.0.0", port: int = 8998, *_: Any, **__: Any):
        self.server = pdlib.BootstrapServer(str(host), int(port))
        self.host = host
        self.port = self.server.port

    def poll(self) -> None:
        return None

    def close(self) -> None:
        self.server.shutdown()

    shutdown = close

