"""pdlib as a vLLM v1 KV connector: PdlibConnector, loaded by vLLM with

    --kv-transfer-config '{"kv_connector": "PdlibConnector",
                           "kv_connector_module_path": "pdlib.vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

Written against upstream vllm-project/vllm, the files read at these commits:
distributed/kv_transfer/kv_connector/v1/base.py @003df2961dd8 (the interface),
v1/core/sched/scheduler.py @00024d314514 (when the scheduler calls the connector),
v1/worker/kv_connector_model_runner_mixin.py @23ec7c7fab7a (when a worker calls it),
v1/core/kv_cache_manager.py @003df2961dd8 (KVCacheBlocks), v1/request.py @000a0d5f815c,
config/kv_transfer.py @007c643b4abb (KVTransferConfig), and NixlConnector
(v1/nixl_connector.py @002a1057e9ae) for the kv_transfer_params routers already pass along.
python/README.md ("vLLM") has the call-by-call table and what is not supported yet.

How vLLM's model maps onto pdlib (decode pull, TransferDirection.Pull):
  * One class, built in the scheduler process (role SCHEDULER) and in every worker (WORKER); a
    facade over _Scheduler or _Worker. They share nothing; the scheduler tells the workers what
    to do through PdlibConnectorMetadata (inside SchedulerOutput, pickled).
  * Prefill's scheduler runs pdlib's bootstrap server in-process (the side channel) and, when a
    request with do_remote_decode finishes, holds its blocks, gives it a room (a counter, unique
    in this bootstrap server's deployment) and returns the kv_transfer_params decode needs.
    Prefill's workers then create a KVSender per request and send() (publish) the block ids;
    the sender's Success (decode read everything) or failure (lease, abort) with
    pages_reusable() reports the request in done_sending, and vLLM frees the blocks.
  * Decode's scheduler reports the prompt's tokens after its local prefix hit as loaded
    asynchronously; its workers create a KVReceiver for the room at prefill's bootstrap address
    and init() it with decode's unhashed blocks, decode_prefix_len = the blocks decode already
    holds, so only the tail is read. Success reports done_recving; a failure reports it too,
    once pdlib says the blocks are reusable, with receiver.invalid_pages() as the load errors
    (vLLM's kv_load_failure_policy then recomputes or fails the request).
  * Handshake and compatibility are pdlib's: a decode worker registers with each prefill rank
    it reads (found through the bootstrap server) on the first request naming it, and prefill
    refuses one whose model fingerprint (layers, heads, head size, dtype, page layout, block
    size, MLA, wire version) differs, naming both values; the request then fails with that
    reason as load errors. Heterogeneous TP is pdlib's planner (heads sliced per page, HND).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import random
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

import pdlib
from pdlib._sglang_args import _local_ip

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as _error:  # pragma: no cover - exercised by test_vllm's subprocess check
    raise ImportError(
        "pdlib.vllm is a vLLM KV connector and needs vLLM: importing KVConnectorBase_V1 from "
        f"vllm.distributed.kv_transfer.kv_connector.v1.base failed ({_error}); install vLLM "
        "(v1 KV connector API) in this environment") from _error

__all__ = ["PdlibConnector", "PdlibConnectorMetadata", "KVCacheDescription",
           "describe_kv_caches"]

logger = logging.getLogger("pdlib.vllm")

# Prefix of the pdlib-specific keys in kv_transfer_params (the NIXL keys are kept as they are,
# so that routers written for NixlConnector pass the parameters along unchanged).
_ROOM_KEY = "pdlib_room"
_BLOCK_SIZE_KEY = "pdlib_block_size"
_MAX_ROOM = (1 << 63) - 1
_MAX_REMOTE_BLOCKS = 1 << 24

_EXTRA_KEYS = {
    "backend": "pdlib's transport ('ucx', 'verbs', 'cuda_ipc', 'fake'); default ucx when built",
    "backend_options": "dict of backend options, e.g. {'ucx.tls': 'rc'}",
    "bootstrap_host": "the address decode reaches prefill's bootstrap server at",
    "bootstrap_port": "prefill's bootstrap port (plus the DP rank); default 8998",
    "listen_host": "where a prefill worker's control endpoint listens; default its own host",
    "pull_lease": "seconds prefill holds published blocks without word from decode; default 480",
    "liveness_timeout": "seconds before a silent peer fails its requests; default 5",
    "connect_timeout": "seconds decode retries bootstrap lookups and connects; default 5",
    "auth_secret": "shared secret of every pdlib control-plane call; default none",
}


class _ConfigError(ValueError):
    pass


@dataclasses.dataclass
class _Settings:
    """kv_connector_extra_config, validated (unknown keys are refused: a typo must not pass)."""

    backend: str
    backend_options: Dict[str, str]
    bootstrap_host: str
    bootstrap_port: int
    listen_host: str
    pull_lease: float
    liveness_timeout: float
    connect_timeout: float
    auth_secret: str

    @classmethod
    def parse(cls, extra: Any, dp_rank: int) -> "_Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise _ConfigError(
                f"pdlib.vllm: unknown kv_connector_extra_config key(s) {unknown}; known: "
                f"{sorted(_EXTRA_KEYS)}")
        backend = extra.get("backend")
        if backend is None:
            available = pdlib.list_backends()
            backend = next((b for b in ("ucx", "verbs") if b in available), "fake")
            if backend == "fake":
                logger.warning("pdlib.vllm: no ucx or verbs backend built; using 'fake', which "
                               "moves no bytes")
        if not isinstance(backend, str) or not backend:
            raise _ConfigError(f"pdlib.vllm: backend must be a backend name, got {backend!r}")
        options = extra.get("backend_options", {})
        if not isinstance(options, dict) or not all(
                isinstance(k, str) and isinstance(v, (str, int, float))
                for k, v in options.items()):
            raise _ConfigError(
                f"pdlib.vllm: backend_options must be a dict of str to str, got {options!r}")
        host = extra.get("bootstrap_host") or os.environ.get("VLLM_HOST_IP") or _local_ip("")
        port = extra.get("bootstrap_port", 8998)
        if isinstance(port, bool) or not isinstance(port, int) or \
                not 0 < port + dp_rank < 65536:
            raise _ConfigError(
                f"pdlib.vllm: bootstrap_port {port!r} (+ DP rank {dp_rank}) is not a port")
        # A worker listens on its own host's address (VLLM_HOST_IP is set per node), which is
        # the bootstrap host's when that is loopback (one machine).
        listen = extra.get("listen_host") or (
            host if host.startswith("127.") or host in ("localhost", "::1") else
            os.environ.get("VLLM_HOST_IP") or _local_ip(host))
        for name, value in (("bootstrap_host", host), ("listen_host", listen)):
            if not isinstance(value, str) or not value:
                raise _ConfigError(f"pdlib.vllm: {name} must be a host name, got {value!r}")
        durations = {}
        for name, default in (("pull_lease", 480.0), ("liveness_timeout", 5.0),
                              ("connect_timeout", 5.0)):
            value = extra.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value < 1.0:
                raise _ConfigError(
                    f"pdlib.vllm: {name} must be a number of seconds >= 1, got {value!r}")
            durations[name] = float(value)
        secret = extra.get("auth_secret", "")
        if not isinstance(secret, str):
            raise _ConfigError("pdlib.vllm: auth_secret must be a string")
        return cls(backend, {str(k): str(v) for k, v in options.items()}, host,
                   port + dp_rank, listen, durations["pull_lease"],
                   durations["liveness_timeout"], durations["connect_timeout"], secret)

    @property
    def bootstrap_address(self) -> str:
        return pdlib_join(self.bootstrap_host, self.bootstrap_port)


def pdlib_join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata


@dataclasses.dataclass
class _SendReq:
    """Prefill: publish these blocks of a finished request under `room`."""

    room: int
    block_ids: List[int]


@dataclasses.dataclass
class _RecvReq:
    """Decode: read the request's blocks from prefill (`bootstrap`, `room`). local_block_ids
    receive the last len(local_block_ids) of prefill's remote_num_blocks blocks. release_only:
    read nothing, only let prefill free its blocks (a full prefix hit, or a request aborted
    before it was scheduled); it is not reported to vLLM. error: refuse the load at once."""

    room: int
    bootstrap: str
    local_block_ids: List[int]
    remote_num_blocks: int
    release_only: bool = False
    error: Optional[str] = None


class PdlibConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers in one step (picklable)."""

    def __init__(self) -> None:
        self.to_send: Dict[str, _SendReq] = {}
        self.to_recv: Dict[str, _RecvReq] = {}


# ---------------------------------------------------------------------------------------------
# kv_transfer_params from prefill, validated on decode


@dataclasses.dataclass
class _Remote:
    room: int
    bootstrap: str
    num_blocks: int
    block_size_error: Optional[str] = None  # set: nothing can be read, only released


def _parse_remote(params: Dict[str, Any], block_size: int) -> _Remote:
    """The parameters prefill's request_finished returned, as the router passed them on; every
    field checked (they crossed two processes and an HTTP router). A block size other than
    decode's is not an error here: the room can still be released."""

    def need(key: str) -> Any:
        if key not in params:
            raise ValueError(f"kv_transfer_params lack '{key}' (not from pdlib.vllm's prefill?)")
        return params[key]

    room = need(_ROOM_KEY)
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= _MAX_ROOM:
        raise ValueError(f"kv_transfer_params {_ROOM_KEY} {room!r} is not a room id")
    host, port = need("remote_host"), need("remote_port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or \
            not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params remote_host/remote_port {host!r}:{port!r} is not "
                         "an address")
    blocks = need("remote_block_ids")
    if not isinstance(blocks, (list, tuple)) or not 0 < len(blocks) <= _MAX_REMOTE_BLOCKS or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise ValueError("kv_transfer_params remote_block_ids must be a non-empty list of "
                         "block ids")
    remote_block_size = need(_BLOCK_SIZE_KEY)
    error = None
    if remote_block_size != block_size:
        error = (f"prefill's block size {remote_block_size!r} differs from decode's "
                 f"{block_size}: not supported (run both with the same --block-size)")
    return _Remote(room, pdlib_join(host, port), len(blocks), error)


# ---------------------------------------------------------------------------------------------
# Scheduler half


class _Scheduler:
    """The connector in vLLM's scheduler process (one per engine core / DP rank). Not
    thread-safe: vLLM calls it from the engine core's thread only."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: _Settings,
                 producer: bool, consumer: bool) -> None:
        self.producer, self.consumer = producer, consumer
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.settings = settings
        self._to_send: Dict[str, _SendReq] = {}
        self._to_recv: Dict[str, _RecvReq] = {}
        # Rooms: a counter from a random start, so a restarted prefill does not reuse the rooms
        # its predecessor handed out while decode may still hold them.
        self._rooms = itertools.count(random.SystemRandom().randrange(1, 1 << 62))
        self._bootstrap: Optional[Any] = None
        if producer:
            self._bootstrap = pdlib.BootstrapServer(settings.bootstrap_host,
                                                    settings.bootstrap_port,
                                                    settings.auth_secret)
            logger.info("pdlib.vllm: bootstrap server on %s (engine %s)",
                        settings.bootstrap_address, self.engine_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.consumer:
            return 0, False  # (kv_producer: logged once by update_state_after_alloc)
        try:
            if _parse_remote(params, self.block_size).block_size_error is not None:
                return 0, False  # computed here (update_state_after_alloc logs why, once)
        except ValueError:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not self.consumer:
            logger.error("pdlib.vllm: request %s has do_remote_prefill, but this engine's "
                         "kv_role is kv_producer: its prompt is computed here",
                         request.request_id)
            return
        try:
            remote = _parse_remote(params, self.block_size)
        except ValueError as e:
            logger.error("pdlib.vllm: request %s computes its prompt locally: %s",
                         request.request_id, e)
            return
        if remote.block_size_error is not None:
            logger.error("pdlib.vllm: request %s computes its prompt locally: %s",
                         request.request_id, remote.block_size_error)
        if num_external_tokens <= 0 or remote.block_size_error is not None:
            # Nothing to read (decode holds the whole prompt, or cannot use prefill's blocks):
            # only let prefill free its blocks now rather than at the lease.
            self._to_recv[request.request_id] = _RecvReq(remote.room, remote.bootstrap, [],
                                                         remote.num_blocks, release_only=True)
            return
        local = [int(b) for b in blocks.get_unhashed_block_ids()]
        error = None
        if not local or len(local) > remote.num_blocks:
            error = (f"decode allocated {len(local)} blocks for a prompt prefill holds in "
                     f"{remote.num_blocks}")
        self._to_recv[request.request_id] = _RecvReq(remote.room, remote.bootstrap, local,
                                                     remote.num_blocks, error=error)

    def build_connector_meta(self, scheduler_output: Any) -> PdlibConnectorMetadata:
        meta = PdlibConnectorMetadata()
        meta.to_send, self._to_send = self._to_send, {}
        meta.to_recv, self._to_recv = self._to_recv, {}
        return meta

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus  # type: ignore[import]

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode finished it before update_state_after_alloc (aborted while waiting): tell
            # prefill to free its blocks now rather than at the lease.
            params["do_remote_prefill"] = False
            try:
                remote = _parse_remote(params, self.block_size)
            except ValueError:
                return False, None
            self._to_recv[request.request_id] = _RecvReq(remote.room, remote.bootstrap, [],
                                                         remote.num_blocks, release_only=True)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not self.producer:
            logger.error("pdlib.vllm: request %s has do_remote_decode, but this engine's kv_role "
                         "is kv_consumer: nothing is handed over", request.request_id)
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None  # aborted (or nothing computed): nothing to hand over
        room = next(self._rooms)
        self._to_send[request.request_id] = _SendReq(room, [int(b) for b in block_ids])
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.settings.bootstrap_host,
            "remote_port": self.settings.bootstrap_port,
            "tp_size": self.tp_size,
            _ROOM_KEY: room,
            _BLOCK_SIZE_KEY: self.block_size,
        }

    def shutdown(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None


# ---------------------------------------------------------------------------------------------
# KV cache tensors -> pdlib buffers

_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
                "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8",
                "uint8": "uint8"}


@dataclasses.dataclass
class KVCacheDescription:
    """vLLM's KV cache tensors as pdlib buffers: (address, bytes, block bytes) per buffer, K of
    every layer then V of every layer (FlashAttention), one per layer (FlashInfer, MLA)."""

    layout: str  # "flash_attn", "flashinfer" or "mla"
    buffers: List[Tuple[int, int, int]]
    num_layers: int
    kv_heads: int  # heads in this rank's blocks (0 for MLA)
    head_dim: int  # elements per head (MLA: the latent's)
    dtype_bytes: int
    kv_dtype: str
    hnd: bool
    is_cuda: bool
    device_id: int


def describe_kv_caches(kv_caches: Dict[str, Any], num_blocks: int, block_size: int,
                       use_mla: bool) -> KVCacheDescription:
    """Reads the layouts vLLM allocates (AttentionBackend.get_kv_cache_shape, permuted by the
    stride order): FlashAttention (2, num_blocks, block_size, heads, head_size), FlashInfer
    (num_blocks, 2, block_size, heads, head_size), MLA (num_blocks, block_size, latent). Layers
    that share one tensor are registered once. Anything else is refused, naming the shape."""
    layers: List[Tuple[int, Tuple[int, ...], Tuple[int, ...], Any]] = []
    seen: Set[Tuple[int, Tuple[int, ...]]] = set()
    for name, tensor in kv_caches.items():
        key = (int(tensor.data_ptr()), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            layers.append((key[0], tuple(int(d) for d in tensor.shape),
                           tuple(int(s) for s in tensor.stride()), tensor))
    if not layers:
        raise ValueError("pdlib.vllm: register_kv_caches got no KV cache tensors")
    first = layers[0][3]
    esize = int(first.element_size())
    kv_dtype = _DTYPE_NAMES.get(str(first.dtype).replace("torch.", ""), "")
    is_cuda = bool(getattr(first, "is_cuda", False))
    device_id = int(first.device.index or 0) if is_cuda else 0
    kinds = []
    described: List[Tuple[str, List[Tuple[int, int, int]], int, int, bool]] = []
    for ptr, shape, stride, tensor in layers:
        if tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError("pdlib.vllm: KV cache tensors of different dtypes or devices are "
                             "not supported (a hybrid model? use --disable-hybrid-kv-cache-manager"
                             " only with uniform attention layers)")
        described.append(_describe_layer(shape, stride, ptr, esize, num_blocks, block_size,
                                         use_mla))
        kinds.append(described[-1][0])
    if len(set((d[0], d[2], d[3], d[4]) for d in described)) != 1:
        raise ValueError(f"pdlib.vllm: KV cache layers differ in layout or shape ({kinds[0]} and "
                         "another): mixed attention backends are not supported")
    layout, _, heads, head_dim, hnd = described[0]
    if layout == "flash_attn":  # K of every layer, then V of every layer
        buffers = [d[1][0] for d in described] + [d[1][1] for d in described]
    else:
        buffers = [d[1][0] for d in described]
    return KVCacheDescription(layout, buffers, len(described), heads, head_dim, esize, kv_dtype,
                              hnd, is_cuda, device_id)


def _describe_layer(shape: Tuple[int, ...], stride: Tuple[int, ...], ptr: int, esize: int,
                    num_blocks: int, block_size: int, use_mla: bool
                    ) -> Tuple[str, List[Tuple[int, int, int]], int, int, bool]:
    where = f"KV cache tensor of shape {shape} (strides {stride})"
    if use_mla:
        if len(shape) != 3 or shape[0] != num_blocks or shape[1] != block_size or \
                stride != (shape[1] * shape[2], shape[2], 1):
            raise ValueError(f"pdlib.vllm: MLA {where} is not a contiguous (num_blocks="
                             f"{num_blocks}, block_size={block_size}, latent) cache")
        item = block_size * shape[2] * esize
        return "mla", [(ptr, num_blocks * item, item)], 0, shape[2], False
    if len(shape) != 5:
        raise ValueError(f"pdlib.vllm: {where}: expected FlashAttention (2, num_blocks, "
                         "block_size, heads, head_size) or FlashInfer (num_blocks, 2, ...)")
    flash = shape[0] == 2 and shape[1] == num_blocks
    flashinfer = shape[1] == 2 and shape[0] == num_blocks
    if flash and flashinfer:
        raise ValueError(f"pdlib.vllm: {where}: with num_blocks == 2 FlashAttention and "
                         "FlashInfer layouts cannot be told apart")
    if not (flash or flashinfer) or shape[2] != block_size:
        raise ValueError(
            f"pdlib.vllm: {where} is neither FlashAttention (2, {num_blocks}, {block_size}, "
            f"heads, head_size) nor FlashInfer ({num_blocks}, 2, {block_size}, heads, "
            "head_size); a kernel block size other than --block-size is not supported")
    heads, dim = shape[3], shape[4]
    page = block_size * heads * dim
    # The page itself: HND [head][token][dim] (what get_required_kvcache_layout asks for) or
    # NHD [token][head][dim].
    if stride[2:] == (dim, block_size * dim, 1):
        hnd = True
    elif stride[2:] == (heads * dim, dim, 1):
        hnd = False
    else:
        raise ValueError(f"pdlib.vllm: {where}: a block is neither HND nor NHD contiguous")
    if flash:
        if stride[:2] != (num_blocks * page, page):
            raise ValueError(f"pdlib.vllm: {where}: K and V are not each one contiguous region")
        item = page * esize
        return "flash_attn", [(ptr, num_blocks * item, item),
                              (ptr + num_blocks * item, num_blocks * item, item)], heads, dim, hnd
    if stride[:2] != (2 * page, page):
        raise ValueError(f"pdlib.vllm: {where}: blocks are not contiguous")
    item = 2 * page * esize  # one block: its K page, then its V page
    return "flashinfer", [(ptr, num_blocks * item, item)], heads, dim, hnd


# ---------------------------------------------------------------------------------------------
# Worker half


@dataclasses.dataclass
class _Receiving:
    receiver: Any
    local_block_ids: List[int]
    started: float
    aborted: bool = False  # vLLM finished the request while it loaded
    abort_sent: bool = False


class _Worker:
    """The connector in one vLLM worker (one TP rank): pdlib's managers over this rank's KV
    cache. vLLM calls it from the worker's thread; the handles are pdlib's (thread-safe)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: _Settings,
                 producer: bool, consumer: bool) -> None:
        from vllm.distributed.parallel_state import (  # type: ignore[import]
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.settings = settings
        self.producer, self.consumer = producer, consumer
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.model_config = vllm_config.model_config
        self.cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.tp_size = int(get_tensor_model_parallel_world_size())
        self.prefill: Optional[Any] = None  # pdlib.KVManager, Mode.Prefill
        self.decode: Optional[Any] = None  # pdlib.KVManager, Mode.Decode
        self.description: Optional[KVCacheDescription] = None
        self._sending: Dict[str, Any] = {}
        self._send_failed_now: Set[str] = set()
        self._failed_senders: List[Tuple[float, Any]] = []  # (close at, sender), in order
        self._recving: Dict[str, _Receiving] = {}
        self._releasing: List[Any] = []
        self._invalid: Set[int] = set()
        self._lock = threading.Lock()  # _invalid: get_block_ids_with_load_errors may race

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        use_mla = bool(getattr(self.model_config, "use_mla", False))
        d = describe_kv_caches(kv_caches, self.num_blocks, self.block_size, use_mla)
        total_heads = 1 if use_mla else int(self.model_config.get_total_num_kv_heads())
        if d.layout == "flash_attn" and d.kv_heads != max(1, total_heads // self.tp_size):
            raise ValueError(
                f"pdlib.vllm: the KV cache holds {d.kv_heads} heads on TP rank {self.tp_rank} of "
                f"{self.tp_size}, the model has {total_heads} KV heads (expected "
                f"{max(1, total_heads // self.tp_size)} per rank)")
        self.description = d
        if self.producer:
            self.prefill = pdlib.KVManager.create(self._options(pdlib.Mode.Prefill, d,
                                                                total_heads))
        if self.consumer:
            self.decode = pdlib.KVManager.create(self._options(pdlib.Mode.Decode, d,
                                                               total_heads))
        logger.info("pdlib.vllm: TP rank %d/%d registered %d %s buffers (%d layers, %s)",
                    self.tp_rank, self.tp_size, len(d.buffers), d.layout, d.num_layers,
                    "HND" if d.hnd else "NHD")

    def _options(self, mode: Any, d: KVCacheDescription, total_heads: int) -> Any:
        s = self.settings
        o = pdlib.KVManagerOptions(mode=mode, backend=s.backend,
                                   backend_options=dict(s.backend_options))
        for ptr, nbytes, item in d.buffers:
            o.args.kv.add(ptr, item, nbytes)
        o.args.page_size = self.block_size
        o.args.is_mla = d.layout == "mla"
        # Heads are sliced per block only in the FlashAttention layout; FlashInfer blocks (K
        # then V of all heads) move whole, which pdlib allows between equal TP only.
        o.args.kv_head_num = d.kv_heads if d.layout == "flash_attn" else 0
        o.args.kv_layout = pdlib.KVLayout.HND if d.hnd else pdlib.KVLayout.NHD
        o.args.parallel = pdlib.ParallelConfig(tp_size=self.tp_size, tp_rank=self.tp_rank)
        o.args.memory_kind = pdlib.MemoryKind.Cuda if d.is_cuda else pdlib.MemoryKind.Host
        o.args.device_id = d.device_id
        kv_dtype = d.kv_dtype
        if self.cache_dtype.startswith("fp8"):
            kv_dtype = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                        "fp8_e5m2": "fp8_e5m2"}.get(self.cache_dtype, "")
        o.args.fingerprint = pdlib.ModelFingerprint(
            num_layers=d.num_layers, num_kv_heads=1 if d.layout == "mla" else total_heads,
            head_dim=d.head_dim, dtype_bytes=d.dtype_bytes,
            model_name=str(getattr(self.model_config, "model", "") or ""), kv_dtype=kv_dtype,
            page_layout=f"vllm-{d.layout}-{'hnd' if d.hnd else 'nhd'}", engine_tag="vllm")
        o.direction = pdlib.TransferDirection.Pull
        o.pull_lease = s.pull_lease
        o.bootstrap_host, o.bootstrap_port = s.bootstrap_host, s.bootstrap_port
        o.listen_host = s.listen_host
        o.liveness_timeout = s.liveness_timeout
        o.connect_timeout = s.connect_timeout
        o.auth_secret = s.auth_secret
        return o

    # -- per step -------------------------------------------------------------------------

    def start_load_kv(self, meta: PdlibConnectorMetadata) -> None:
        for req_id, send in meta.to_send.items():
            self._publish(req_id, send)
        for req_id, recv in meta.to_recv.items():
            self._start_read(req_id, recv)

    def _publish(self, req_id: str, send: _SendReq) -> None:
        if self.prefill is None:
            logger.error("pdlib.vllm: request %s finished with do_remote_decode on an engine "
                         "whose kv_role is kv_consumer: its blocks are freed", req_id)
            self._send_failed_now.add(req_id)
            return
        try:
            sender = self.prefill.create_sender(send.room)
        except pdlib.Error as e:
            logger.error("pdlib.vllm: request %s (room %d): %s", req_id, send.room, e)
            self._send_failed_now.add(req_id)
            return
        try:
            sender.init(len(send.block_ids), None)
            sender.send(np.asarray(send.block_ids, dtype=np.int32), True)
        except (pdlib.Error, TypeError, ValueError) as e:
            logger.error("pdlib.vllm: request %s (room %d): publishing its blocks failed: %s",
                         req_id, send.room, e)
            sender.abort(f"publishing failed: {e}")
        self._sending[req_id] = sender

    def _start_read(self, req_id: str, recv: _RecvReq) -> None:
        if self.decode is None:
            if not recv.release_only:
                logger.error("pdlib.vllm: request %s has do_remote_prefill on an engine whose "
                             "kv_role is kv_producer", req_id)
                self._fail_now(req_id, recv.local_block_ids)
            return
        if recv.error is not None:
            logger.error("pdlib.vllm: request %s (room %d): %s", req_id, recv.room, recv.error)
            self._fail_now(req_id, recv.local_block_ids)
            recv = _RecvReq(recv.room, recv.bootstrap, [], recv.remote_num_blocks,
                            release_only=True)  # and let prefill free its blocks
            req_id = f"{req_id} (release)"
        prefix_blocks = recv.remote_num_blocks - len(recv.local_block_ids)
        try:
            receiver = self.decode.create_receiver(recv.bootstrap, recv.room)
        except pdlib.Error as e:
            logger.error("pdlib.vllm: request %s (room %d at %s): %s", req_id, recv.room,
                         recv.bootstrap, e)
            if not recv.release_only:
                self._fail_now(req_id, recv.local_block_ids)
            return
        try:
            receiver.init(np.asarray(recv.local_block_ids, dtype=np.int32), None,
                          decode_prefix_len=prefix_blocks * self.block_size)
        except (pdlib.Error, TypeError, ValueError) as e:
            logger.error("pdlib.vllm: request %s (room %d): %s", req_id, recv.room, e)
            receiver.abort(f"init failed: {e}")
        if recv.release_only:
            self._releasing.append(receiver)
        else:
            self._recving[req_id] = _Receiving(receiver, recv.local_block_ids, time.monotonic())

    def _fail_now(self, req_id: str, blocks: List[int]) -> None:
        """A load that never started: every block is a load error, reported with the request in
        the next get_finished (nothing can write them)."""
        with self._lock:
            self._invalid.update(blocks)
        self._recving[req_id] = _Receiving(None, blocks, time.monotonic())

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        # Requests vLLM finished (aborted) while their load ran: stop reading. vLLM keeps their
        # blocks until they are reported received, which happens once pdlib frees them.
        # pdlib tells prefill of an abort only once the receiver is bound to it, so one still
        # Bootstrapping is aborted when it leaves that state (prefill then frees its blocks at
        # once instead of at the lease).
        for req_id in finished_req_ids:
            r = self._recving.get(req_id)
            if r is not None and r.receiver is not None:
                r.aborted = True
        for r in self._recving.values():
            if r.aborted and not r.abort_sent and \
                    r.receiver.poll() != pdlib.KVPoll.Bootstrapping:
                r.abort_sent = True
                r.receiver.abort("the request was finished by vLLM")
        done_recving: Set[str] = set()
        for req_id, r in list(self._recving.items()):
            if r.receiver is None:
                done_recving.add(req_id)
                del self._recving[req_id]
                continue
            state = r.receiver.poll()
            if state == pdlib.KVPoll.Success:
                pass
            elif state == pdlib.KVPoll.Failed and r.receiver.pages_reusable():
                invalid = r.receiver.invalid_pages()
                if not r.aborted:
                    logger.warning("pdlib.vllm: request %s: loading its KV failed (%d of %d "
                                   "blocks not loaded): %s", req_id, len(invalid),
                                   len(r.local_block_ids), r.receiver.failure_reason())
                    with self._lock:
                        self._invalid.update(int(b) for b in invalid)
            else:
                continue
            r.receiver.close()
            done_recving.add(req_id)
            del self._recving[req_id]
        done_sending: Set[str] = set(self._send_failed_now)
        self._send_failed_now.clear()
        now = time.monotonic()
        for req_id, sender in list(self._sending.items()):
            state = sender.poll()
            if state == pdlib.KVPoll.Failed and sender.pages_reusable():
                logger.warning("pdlib.vllm: request %s: its blocks are freed without decode "
                               "having read them: %s", req_id, sender.failure_reason())
                # Kept (failed, holding nothing) for another lease, so that a decode that comes
                # late is told why at once instead of waiting for a room nobody serves.
                self._failed_senders.append((now + self.settings.pull_lease, sender))
            elif state == pdlib.KVPoll.Success:
                sender.close()
            else:
                continue
            done_sending.add(req_id)
            del self._sending[req_id]
        while self._failed_senders and self._failed_senders[0][0] <= now:
            self._failed_senders.pop(0)[1].close()
        still = []
        for receiver in self._releasing:
            if receiver.poll().is_terminal:
                receiver.close()
            else:
                still.append(receiver)
        self._releasing = still
        return done_sending or None, done_recving or None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for name, manager in (("prefill", self.prefill), ("decode", self.decode)):
            if manager is not None and not manager.closed:
                out[name] = manager.metrics()
        return out

    def shutdown(self) -> None:
        for manager in (self.decode, self.prefill):
            if manager is not None:
                manager.close()
        self.decode = self.prefill = None


# ---------------------------------------------------------------------------------------------
# The connector vLLM builds


class PdlibConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over pdlib (decode pull). Built by vLLM's KVConnectorFactory in the
    scheduler process (role SCHEDULER) and in every worker (role WORKER); each call is forwarded
    to the half of its role."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
            raise ValueError("pdlib.vllm: pipeline parallelism is not supported yet")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                f"pdlib.vllm: {len(groups)} KV cache groups (hybrid model or hybrid allocator): "
                "not supported; use a model with uniform attention layers")
        dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        settings = _Settings.parse(transfer.kv_connector_extra_config, dp_rank)
        producer = bool(transfer.is_kv_producer)
        consumer = bool(transfer.is_kv_consumer)
        self._scheduler: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, kv_cache_config, settings, producer,
                                         consumer)
        elif role == KVConnectorRole.WORKER:
            self._worker = _Worker(vllm_config, kv_cache_config, settings, producer, consumer)
        else:
            raise ValueError(f"pdlib.vllm: unknown connector role {role!r}")

    # -- class methods --------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None  # MLA has no heads to slice
        return "HND"  # a head range of a block is one contiguous piece

    # -- scheduler side -------------------------------------------------------------------

    def _sched(self) -> _Scheduler:
        if self._scheduler is None:
            raise RuntimeError("pdlib.vllm: a scheduler-side method called on a worker")
        return self._scheduler

    def _work(self) -> _Worker:
        if self._worker is None:
            raise RuntimeError("pdlib.vllm: a worker-side method called on the scheduler")
        return self._worker

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PdlibConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: Dict[int, Any]) -> None:
        return None  # the workers register with pdlib's bootstrap server themselves

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PdlibConnectorMetadata):
            raise TypeError(f"pdlib.vllm: connector metadata is a {type(meta).__name__}")
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole requests load between steps (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # prefill publishes finished requests' blocks; nothing per layer

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> None:
        return None

    def get_kv_connector_stats(self) -> None:
        return None

    def pdlib_stats(self) -> Dict[str, Any]:
        """pdlib's metrics of this worker's managers ({"prefill": ..., "decode": ...})."""
        return self._work().stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
