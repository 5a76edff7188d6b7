"""pdlib as an SGLang disaggregation transfer backend.

The classes here have the shapes of SGLang's backend interface
(sglang/srt/disaggregation/base/conn.py: KVArgs, KVManager, KVSender, KVReceiver,
KVBootstrapServer, KVPoll), so SGLang's prefill and decode schedulers can drive pdlib where
they drive Mooncake or NIXL today. python/README.md ("SGLang") has the field-by-field mapping
and the two lines that select this backend in SGLang.

Where the shapes differ, this module translates:
  * SGLang calls send(kv_indices) once per prefill chunk and never says which chunk is the
    last; the sender counts pages against init(num_kv_indices) and passes is_last_chunk.
  * SGLang's send() and init() do not raise on a transfer error; a pdlib error there fails the
    request (Abort with pdlib's reason) so that poll() turns Failed and failure_exception()
    raises it, as SGLang's scheduler expects.
  * SGLang addresses the bootstrap server as "host:port"; pdlib's decode looks up prefill ranks
    there itself, so dest_tp_ranks and pp_rank are informational only.
  * Index arrays of any integer dtype are accepted (SGLang passes int64 at times) and converted
    to int32 once, with a range check.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

import pdlib
from pdlib import KVPoll  # SGLang compares poll() results with KVPoll.Success etc.

__all__ = [
    "KVArgs",
    "KVPoll",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "KVBootstrapServer",
    "KVTransferError",
    "DisaggregationMode",
]


class DisaggregationMode:
    """The values of SGLang's DisaggregationMode (an enum whose .value is one of these)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(pdlib.Error):
    """What failure_exception() raises: the room and pdlib's reason, intact."""

    def __init__(self, bootstrap_room: int, failure_reason: str,
                 cause: Optional[pdlib.Error] = None):
        super().__init__(f"KVTransferError(bootstrap_room={bootstrap_room}): {failure_reason}",
                         int(cause.code) if cause is not None else None,
                         cause.reason if cause is not None else failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason


class KVArgs:
    """SGLang's KVArgs: the engine fills these attributes before creating the manager.

    State buffers may be flat lists (one state type) or lists of lists (SGLang's newer
    per-state-type layout; the first non-empty group is used, pdlib carries one state family).
    """

    def __init__(self) -> None:
        self.engine_rank: int = 0
        self.kv_data_ptrs: List[int] = []
        self.kv_data_lens: List[int] = []
        self.kv_item_lens: List[int] = []
        self.aux_data_ptrs: List[int] = []
        self.aux_data_lens: List[int] = []
        self.aux_item_lens: List[int] = []
        self.state_data_ptrs: List[Any] = []
        self.state_data_lens: List[Any] = []
        self.state_item_lens: List[Any] = []
        self.state_type: Any = "none"
        self.state_dim_per_tensor: List[Any] = []
        self.ib_device: Optional[str] = None
        self.ib_traffic_class: Optional[str] = None
        self.gpu_id: int = 0
        self.kv_head_num: int = 0
        self.total_kv_head_num: int = 0
        self.page_size: int = 1
        self.decode_tp_size: int = 1
        self.prefill_pp_size: int = 1
        self.pp_rank: int = 0
        self.prefill_start_layer: int = 0
        self.system_dp_rank: int = 0
        # Not in SGLang's KVArgs; pdlib's fingerprint and page layout. None: derived (see
        # KVManager). Both sides must end up with the same values.
        self.num_layers: Optional[int] = None
        self.model_name: str = ""
        # The KV element type by name (pdlib.element_type_names()); "": server_args's
        # kv_cache_dtype when it names one ("fp8_e4m3", "bf16", ...; not "auto").
        self.kv_dtype: str = ""
        self.kv_layout: pdlib.KVLayout = pdlib.KVLayout.NHD  # SGLang's pools: [token][head][dim]
        self.memory_kind: Optional[pdlib.MemoryKind] = None


def _mode_name(mode: Any) -> str:
    value = getattr(mode, "value", mode)
    if isinstance(value, pdlib.Mode):
        return "prefill" if value == pdlib.Mode.Prefill else "decode"
    return str(value).lower()


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _flat_state(values: Sequence[Any]) -> List[int]:
    """SGLang's newer KVArgs nest state lists per state type; pdlib takes one family."""
    if values and isinstance(values[0], (list, tuple)):
        for group in values:
            if group:
                return [int(v) for v in group]
        return []
    return [int(v) for v in values]


_STATE_TYPES = {"none": pdlib.StateType.Null, "mamba": pdlib.StateType.Mamba,
                "swa": pdlib.StateType.Swa, "nsa": pdlib.StateType.Nsa,
                "dsa": pdlib.StateType.Nsa}


class KVManager:
    """KVManager(args, disaggregation_mode, server_args, is_mla_backend) over pdlib.

    Read from server_args (by attribute, all optional): tp_size, dp_size, pp_size,
    disaggregation_bootstrap_port, host, model_path, disaggregation_ib_device, and
    pdlib_backend / pdlib_backend_options (else the PDLIB_SGLANG_BACKEND and
    PDLIB_SGLANG_BACKEND_OPTIONS="k=v,k=v" environment, else "ucx" when built, else "fake").
    Timeouts come from SGLang's environment (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT,
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT, in seconds) or pdlib's defaults. A prefill manager
    registers with the bootstrap server at (server_args.disaggregation_bootstrap_host or
    127.0.0.1):disaggregation_bootstrap_port; start it with KVBootstrapServer, as SGLang does.
    """

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        mode = _mode_name(disaggregation_mode)
        if mode not in ("prefill", "decode"):
            raise ValueError(f"pdlib.sglang.KVManager: unsupported mode {disaggregation_mode!r}")
        self.options = self._options(args, mode, server_args)
        self.manager = pdlib.KVManager.create(self.options)

    @staticmethod
    def _get(server_args: Any, name: str, default: Any) -> Any:
        value = getattr(server_args, name, None) if server_args is not None else None
        return default if value is None else value

    def _options(self, a: KVArgs, mode: str, s: Any) -> pdlib.KVManagerOptions:
        get = self._get
        backend = get(s, "pdlib_backend", os.environ.get("PDLIB_SGLANG_BACKEND"))
        if backend is None:
            backend = "ucx" if "ucx" in pdlib.list_backends() else "fake"
        backend_options = get(s, "pdlib_backend_options", None)
        if backend_options is None:
            text = os.environ.get("PDLIB_SGLANG_BACKEND_OPTIONS", "")
            backend_options = dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)
        o = pdlib.KVManagerOptions(
            mode=pdlib.Mode.Prefill if mode == "prefill" else pdlib.Mode.Decode,
            backend=backend, backend_options=dict(backend_options))
        o.args.kv = pdlib.BufferFamily(list(a.kv_data_ptrs), list(a.kv_data_lens),
                                       list(a.kv_item_lens))
        o.args.aux = pdlib.BufferFamily(list(a.aux_data_ptrs), list(a.aux_data_lens),
                                        list(a.aux_item_lens))
        state_ptrs = _flat_state(a.state_data_ptrs)
        if state_ptrs:
            o.args.state = pdlib.BufferFamily(state_ptrs, _flat_state(a.state_data_lens),
                                              _flat_state(a.state_item_lens))
            state_type = getattr(a.state_type, "value", a.state_type)
            if isinstance(state_type, (list, tuple)):
                state_type = state_type[0] if state_type else "none"
            o.args.state_type = _STATE_TYPES[str(getattr(state_type, "value", state_type))]
            if a.state_dim_per_tensor:
                o.args.state_dim_per_tensor = _flat_state(a.state_dim_per_tensor)
        o.args.page_size = int(a.page_size)
        tp_size = int(get(s, "tp_size", 1))
        dp_size = int(get(s, "dp_size", 1))
        if get(s, "enable_dp_attention", False):
            tp_size //= max(dp_size, 1)  # SGLang's attention TP size
        tp_size = max(tp_size, 1)
        pp_size = int(get(s, "pp_size", 1))
        o.args.parallel = pdlib.ParallelConfig(
            tp_size=tp_size, tp_rank=int(a.engine_rank) % tp_size, dp_size=dp_size,
            dp_rank=int(a.system_dp_rank) % max(dp_size, 1), pp_size=pp_size,
            pp_rank=int(a.pp_rank))
        o.args.prefill_start_layer = int(a.prefill_start_layer)
        o.args.is_mla = self.is_mla_backend
        heads_here = 1 if self.is_mla_backend else int(a.kv_head_num or 0)
        total_heads = int(a.total_kv_head_num or heads_here * tp_size) or 1
        o.args.kv_head_num = heads_here
        o.args.kv_layout = a.kv_layout
        buffers_per_layer = 1 if self.is_mla_backend else 2
        layers = a.num_layers or (len(a.kv_data_ptrs) // buffers_per_layer) * pp_size
        item = int(a.kv_item_lens[0]) if a.kv_item_lens else 0
        # head_dim * dtype bytes of one head, as bytes: both sides derive the same number.
        head_bytes = item // max(1, a.page_size * max(heads_here, 1))
        kv_dtype = str(a.kv_dtype or "")
        if not kv_dtype:
            named = str(get(s, "kv_cache_dtype", "") or "")
            kv_dtype = named if named in pdlib.element_type_names() else ""
        # Sizes in bytes unless the element type is known (a bf16 and an fp16 side would agree
        # on bytes alone; the name tells them apart).
        elem = pdlib.element_type_bytes(kv_dtype) if kv_dtype else 1
        o.args.fingerprint = pdlib.ModelFingerprint(
            num_layers=int(layers), num_kv_heads=1 if self.is_mla_backend else total_heads,
            head_dim=int(head_bytes) // elem, dtype_bytes=elem, layout_version=1,
            model_name=str(a.model_name or ""), kv_dtype=kv_dtype)
        o.args.device_id = int(a.gpu_id or 0)
        if a.memory_kind is not None:
            o.args.memory_kind = a.memory_kind
        if a.ib_device:
            o.args.nic_names = [d for d in str(a.ib_device).split(",") if d]
        o.bootstrap_host = str(get(s, "disaggregation_bootstrap_host", "127.0.0.1"))
        o.bootstrap_port = int(get(s, "disaggregation_bootstrap_port", 8998))
        o.listen_host = str(get(s, "pdlib_listen_host", "127.0.0.1"))
        o.bootstrap_timeout = _env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                                           o.bootstrap_timeout)
        o.waiting_timeout = _env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                                         o.waiting_timeout)
        for name in ("liveness_timeout", "connect_timeout", "transfer_timeout"):
            setattr(o, name, float(get(s, "pdlib_" + name, getattr(o, name))))
        return o

    def register_to_bootstrap(self) -> None:
        """pdlib registers with the bootstrap server when the manager is created."""

    def close(self) -> None:
        self.manager.close()


def _indices(values: Any, what: str) -> Optional[np.ndarray[Any, np.dtype[np.int32]]]:
    """int32, contiguous, range-checked: what pdlib takes without another copy."""
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == np.int32 and values.ndim == 1 \
            and values.flags["C_CONTIGUOUS"]:
        return values
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


def _state_indices(values: Any) -> Optional[np.ndarray[Any, np.dtype[np.int32]]]:
    if values is None:
        return None
    if isinstance(values, (list, tuple)) and values and isinstance(values[0], (list, tuple,
                                                                               np.ndarray)):
        values = values[0]  # SGLang's newer per-state-type lists: pdlib carries one family
    return _indices(values, "state_indices")


class _Handle:
    """What SGLang's sender and receiver share: poll, failure_exception, abort, clear."""

    handle: Union[pdlib.KVSender, pdlib.KVReceiver]
    bootstrap_room: int

    def poll(self) -> KVPoll:
        return self.handle.poll()

    def failure_exception(self) -> None:
        reason = self.handle.failure_reason()
        if reason is None:
            reason = pdlib.UnknownError("UNKNOWN: failure_exception() on a request that has"
                                        f" not failed (state {self.handle.poll().name})")
        raise KVTransferError(self.bootstrap_room, str(reason), reason) from reason

    def abort(self) -> None:
        self.handle.abort("aborted by the SGLang scheduler")

    def pages_reusable(self) -> bool:
        """pdlib's page-reuse rule: free this request's pages only once this is True."""
        return self.handle.pages_reusable()

    def clear(self) -> None:
        """Releases the request's room. Its pages stay untouched by pdlib only if
        pages_reusable() was True; otherwise collect them with take_reusable_rooms()."""
        self.handle.close()

    def _fail(self, error: pdlib.Error) -> None:
        # SGLang does not expect send()/init() to raise: fail the request with the reason.
        self.handle.abort(str(error))


class KVSender(_Handle):
    """KVSender(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank): prefill."""

    handle: pdlib.KVSender

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Optional[List[int]] = None, pp_rank: int = 0, *_: Any,
                 **__: Any):
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.handle = mgr.manager.create_sender(self.bootstrap_room)
        self.num_kv_indices: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.curr_idx = 0

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        try:
            self.handle.init(self.num_kv_indices, self.aux_index)
        except pdlib.Error as e:
            self._fail(e)

    def send(self, kv_indices: Any, state_indices: Any = None, *_: Any, **__: Any) -> None:
        pages = _indices(kv_indices, "kv_indices")
        assert pages is not None
        self.curr_idx += len(pages)
        # SGLang never says which chunk is the last: the one that completes num_kv_indices is.
        is_last = self.num_kv_indices is not None and self.curr_idx >= self.num_kv_indices
        try:
            self.handle.send(pages, is_last, _state_indices(state_indices) if is_last else None)
        except pdlib.Error as e:
            self._fail(e)


class KVReceiver(_Handle):
    """KVReceiver(mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank): decode.

    init(kv_indices, aux_index, state_indices) hands over the destination pages (SGLang's
    shape until it split it in two); init(prefill_dp_rank) + send_metadata(kv_indices,
    aux_index, state_indices) (the newer shape) is accepted too.
    """

    handle: pdlib.KVReceiver

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, *_: Any, **__: Any):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.prefill_dp_rank = prefill_dp_rank
        self.handle = mgr.manager.create_receiver(bootstrap_addr, self.bootstrap_room,
                                                  prefill_dp_rank)

    def init(self, kv_indices: Any = None, aux_index: Optional[int] = None,
             state_indices: Any = None, *_: Any, **__: Any) -> None:
        if kv_indices is None or isinstance(kv_indices, (int, np.integer)):
            return  # the newer shape: init(prefill_dp_rank); the pages come in send_metadata
        self.send_metadata(kv_indices, aux_index, state_indices)

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Any = None, *_: Any, **__: Any) -> None:
        try:
            self.handle.init(_indices(kv_indices, "kv_indices"), aux_index,
                             _state_indices(state_indices))
        except pdlib.Error as e:
            self._fail(e)


class KVBootstrapServer:
    """KVBootstrapServer(host, port): the bootstrap server of one prefill deployment, in this
    process (SGLang starts it next to the prefill scheduler)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 8998, *_: Any, **__: Any):
        self.server = pdlib.BootstrapServer(host, port)
        self.host = host
        self.port = self.server.port

    def close(self) -> None:
        self.server.shutdown()

    shutdown = close
