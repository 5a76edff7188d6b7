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
from pdlib import _vllm_layout as _layout
from pdlib._sglang_args import _local_ip, checksum_setting

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
from vllm.distributed.kv_transfer.kv_connector.v1 import (  # type: ignore[import]  # noqa: E402
    base as _vllm_base,
)

# The hybrid memory allocator's mixin (vLLM refuses a connector without it when HMA is on); an
# older vLLM without it has one KV cache group and calls request_finished only.
_SupportsHMA: Any = getattr(_vllm_base, "SupportsHMA", object)

__all__ = ["PdlibConnector", "PdlibConnectorMetadata", "KVCacheDescription",
           "describe_kv_caches"]

logger = logging.getLogger("pdlib.vllm")

# Prefix of the pdlib-specific keys in kv_transfer_params (the NIXL keys are kept as they are,
# so that routers written for NixlConnector pass the parameters along unchanged).
_ROOM_KEY = "pdlib_room"
_BLOCK_SIZE_KEY = "pdlib_block_size"
_GROUPS_KEY = "pdlib_group_blocks"  # blocks prefill sends per KV cache group (hybrid)
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
    "checksum": "off | sampled | all: pdlib's end-to-end KV digest (README \"KV integrity\"); "
                "default off; the same on both sides",
    "checksum_sample_every": "with checksum sampled: 1 request in this many; default 64",
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
    checksum: pdlib.KvChecksum = pdlib.KvChecksum.Off
    checksum_sample_every: int = 64

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
        try:
            checksum, every = checksum_setting(str(extra.get("checksum", "off")),
                                               str(extra.get("checksum_sample_every", 64)),
                                               "pdlib.vllm: checksum")
        except ValueError as e:
            raise _ConfigError(str(e)) from e
        return cls(backend, {str(k): str(v) for k, v in options.items()}, host,
                   port + dp_rank, listen, durations["pull_lease"],
                   durations["liveness_timeout"], durations["connect_timeout"], secret,
                   checksum, every)

    @property
    def bootstrap_address(self) -> str:
        return pdlib_join(self.bootstrap_host, self.bootstrap_port)


def pdlib_join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# KV cache groups (vLLM's hybrid memory allocator: one block table per group)


@dataclasses.dataclass
class _Group:
    """One of kv_cache_config.kv_cache_groups, as pdlib moves it. kind: "full" (full attention,
    MLA included: pdlib's KV pages), "swa" (sliding window: a state family of the window's
    blocks) or "mamba" (linear attention / SSM: a state family of one block, the running
    state)."""

    index: int
    kind: str
    layer_names: List[str]
    spec: Any
    block_size: int
    window_blocks: int = 0  # swa: blocks that can hold tokens of the last token's window
    spec_blocks: int = 0  # mamba: trailing blocks vLLM keeps for speculative decoding


def _spec_names(spec: Any) -> Set[str]:
    return {c.__name__ for c in type(spec).__mro__}


def _groups(kv_cache_config: Any, vllm_config: Any) -> List[_Group]:
    """kv_cache_config's groups by what their KV cache spec is (its class, MLA and Mamba
    subclasses included). A config without groups (or without specs) is one full-attention
    group of every layer. Refuses what pdlib cannot move, naming it."""
    block_size = int(vllm_config.cache_config.block_size)
    raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not raw or all(getattr(g, "kv_cache_spec", None) is None for g in raw):
        names = [n for g in raw for n in getattr(g, "layer_names", [])]
        return [_Group(0, "full", names, None, block_size)]
    out: List[_Group] = []
    for i, g in enumerate(raw):
        spec = g.kv_cache_spec
        kinds = _spec_names(spec)
        size = int(getattr(spec, "block_size", block_size))
        if "MambaSpec" in kinds:
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            if mode != "none":
                raise _ConfigError(
                    f"pdlib.vllm: KV cache group {i} is Mamba state with mamba_cache_mode "
                    f"{mode!r}: pdlib moves the running state of mode 'none' only (a state "
                    "per block position, or one held in the prefix cache, is not supported "
                    "yet); run without prefix caching for Mamba layers")
            out.append(_Group(i, "mamba", list(g.layer_names), spec, size,
                              spec_blocks=int(getattr(spec, "num_speculative_blocks", 0))))
        elif "SlidingWindowSpec" in kinds:
            window = int(spec.sliding_window)
            out.append(_Group(i, "swa", list(g.layer_names), spec, size,
                              window_blocks=-(-window // size) + 1))
        elif "FullAttentionSpec" in kinds and not kinds & {"ChunkedLocalAttentionSpec",
                                                            "CrossAttentionSpec"}:
            out.append(_Group(i, "full", list(g.layer_names), spec, size))
        else:
            raise _ConfigError(
                f"pdlib.vllm: KV cache group {i} has a {type(spec).__name__}: pdlib moves full "
                "attention (MLA included), sliding-window and Mamba groups")
    full = [g for g in out if g.kind == "full"]
    if len(full) != 1:
        raise _ConfigError(
            f"pdlib.vllm: {len(full)} full-attention KV cache groups "
            f"({[type(g.spec).__name__ for g in out]}): pdlib needs exactly one (its KV pages; "
            "the others become state families)")
    if full[0].block_size != block_size:
        raise _ConfigError(
            f"pdlib.vllm: the full-attention group's block size {full[0].block_size} differs "
            f"from --block-size {block_size}")
    return out


def _clip(group: _Group, block_ids: List[int]) -> List[int]:
    """The blocks of a group that hold what decode needs, as NixlConnector clips them
    (get_exchange_clipped_blocks @6adad087): every block of full attention; the window's
    tail of a sliding-window group (vLLM's null block 0 stands for the freed ones); the running
    state of a Mamba group (the last block before the speculative ones)."""
    if group.kind == "full":
        return list(block_ids)
    real = [b for b in block_ids if b != 0]
    if group.kind == "swa":
        return real[-group.window_blocks:] if real else []
    if group.spec_blocks and len(real) > 1:
        real = real[:-min(group.spec_blocks, len(real) - 1)]
    return real[-1:]


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata


@dataclasses.dataclass
class _SendReq:
    """Prefill: publish these blocks of a finished request under `room`: the full-attention
    group's, then one list per other group (state families, in group order)."""

    room: int
    block_ids: List[int]
    state_ids: List[List[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _RecvReq:
    """Decode: read the request's blocks from prefill (`bootstrap`, `room`). local_block_ids
    (the full-attention group's) receive the last len(local_block_ids) of prefill's
    remote_num_blocks blocks; state_ids one list per other group. release_only: read nothing,
    only let prefill free its blocks (a full prefix hit, or a request aborted before it was
    scheduled); it is not reported to vLLM. error: refuse the load at once (every block a load
    error)."""

    room: int
    bootstrap: str
    local_block_ids: List[int]
    remote_num_blocks: int
    release_only: bool = False
    error: Optional[str] = None
    state_ids: List[List[int]] = dataclasses.field(default_factory=list)

    @property
    def all_block_ids(self) -> List[int]:
        """Every vLLM block the load writes, in every group: what a failure reports."""
        out = list(self.local_block_ids)
        for ids in self.state_ids:
            out.extend(ids)
        return out


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
    group_blocks: List[int] = dataclasses.field(default_factory=list)


def _parse_remote(params: Dict[str, Any], block_size: int, num_groups: int = 1) -> _Remote:
    """The parameters prefill's request_finished returned, as the router passed them on; every
    field checked (they crossed two processes and an HTTP router). A block size (or a group
    list) other than decode's is not an error here: the room can still be released."""

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
    groups = params.get(_GROUPS_KEY, [len(blocks)])
    if not isinstance(groups, (list, tuple)) or not groups or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _MAX_REMOTE_BLOCKS
            for n in groups) or groups[0] != len(blocks):
        raise ValueError(f"kv_transfer_params {_GROUPS_KEY} {groups!r} is not a block count "
                         "per KV cache group starting with len(remote_block_ids)")
    remote_block_size = need(_BLOCK_SIZE_KEY)
    error = None
    if remote_block_size != block_size:
        error = (f"prefill's block size {remote_block_size!r} differs from decode's "
                 f"{block_size}: not supported (run both with the same --block-size)")
    elif len(groups) != num_groups:
        error = (f"prefill has {len(groups)} KV cache groups, decode {num_groups}: not the "
                 "same model")
    return _Remote(room, pdlib_join(host, port), len(blocks), error, [int(n) for n in groups])


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
        self.groups = _groups(kv_cache_config, vllm_config)
        self.full = next(g.index for g in self.groups if g.kind == "full")
        self.has_mamba = any(g.kind == "mamba" for g in self.groups)
        self.has_swa = any(g.kind == "swa" for g in self.groups)
        self._to_send: Dict[str, _SendReq] = {}
        self._to_recv: Dict[str, _RecvReq] = {}
        self._computed_locally: Set[str] = set()  # decode: logged why, once
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

    def _remote_tokens(self, request: Any) -> int:
        """The prompt tokens prefill computed: all of them, or all but the last with Mamba
        groups (decode recomputes the last token, so the state it gets must be the one before
        it; prefill's prompt is cut the same way, see _truncate_for_mamba)."""
        n = len(request.prompt_token_ids or ())
        return n - 1 if self.has_mamba and n > 1 else n

    def _truncate_for_mamba(self, request: Any) -> None:
        """Prefill of a model with Mamba groups: compute the prompt without its last token
        (h(N-1)); decode computes that token from the state it reads. As NixlConnector's
        _truncate_mamba_request_for_prefill (@6adad087), once per request."""
        params = request.kv_transfer_params
        if params.get("_pdlib_truncated") or request.num_prompt_tokens <= 1 or \
                request.prompt_token_ids is None:
            return
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_pdlib_truncated"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.producer and self.has_mamba:
            self._truncate_for_mamba(request)
        if not params or not params.get("do_remote_prefill") or not self.consumer:
            return 0, False  # (kv_producer: logged once by update_state_after_alloc)
        try:
            if _parse_remote(params, self.block_size,
                             len(self.groups)).block_size_error is not None:
                return 0, False  # computed here (update_state_after_alloc logs why, once)
        except ValueError:
            return 0, False
        if self.has_swa and num_computed_tokens > 0:
            # The window's blocks would then be partly decode's own (cached) and partly read:
            # not supported yet, so decode computes the prompt (its prefix hit still counts).
            if request.request_id not in self._computed_locally:
                self._computed_locally.add(request.request_id)
                logger.info("pdlib.vllm: request %s: a local prefix hit of %d tokens on a "
                            "model with sliding-window groups: computed here",
                            request.request_id, num_computed_tokens)
            return 0, False
        count = self._remote_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _local_groups(self, blocks: Any) -> List[List[int]]:
        if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
            return [[int(b) for b in ids] for ids in blocks.get_unhashed_block_ids_all_groups()]
        return [[int(b) for b in blocks.get_unhashed_block_ids()]]

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return  # (the second call for a request, after its load, lands here too)
        params["do_remote_prefill"] = False  # one transfer per request
        self._computed_locally.discard(request.request_id)
        if not self.consumer:
            logger.error("pdlib.vllm: request %s has do_remote_prefill, but this engine's "
                         "kv_role is kv_producer: its prompt is computed here",
                         request.request_id)
            return
        try:
            remote = _parse_remote(params, self.block_size, len(self.groups))
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
        per_group = self._local_groups(blocks)
        error = None
        local: List[int] = []
        states: List[List[int]] = []
        if len(per_group) != len(self.groups):
            error = (f"the scheduler allocated {len(per_group)} KV cache groups, the config "
                     f"has {len(self.groups)}")
        else:
            local = per_group[self.full]
            if not local or len(local) > remote.num_blocks:
                error = (f"decode allocated {len(local)} blocks for a prompt prefill holds in "
                         f"{remote.num_blocks}")
            for g in self.groups:
                if g.index == self.full:
                    continue
                want = remote.group_blocks[g.index]
                mine = _clip(g, per_group[g.index])
                if g.kind == "swa":
                    mine = mine[-want:] if want else []
                if len(mine) != want:
                    error = error or (
                        f"KV cache group {g.index} ({g.kind}): decode has {len(mine)} blocks "
                        f"for the {want} prefill sends")
                states.append(mine)
        self._to_recv[request.request_id] = _RecvReq(remote.room, remote.bootstrap, local,
                                                     remote.num_blocks, error=error,
                                                     state_ids=states)

    def build_connector_meta(self, scheduler_output: Any) -> PdlibConnectorMetadata:
        meta = PdlibConnectorMetadata()
        meta.to_send, self._to_send = self._to_send, {}
        meta.to_recv, self._to_recv = self._to_recv, {}
        return meta

    def request_finished(self, request: Any, block_ids: Tuple[List[int], ...]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        from vllm.v1.request import RequestStatus  # type: ignore[import]

        params = request.kv_transfer_params
        if not params:
            return False, None
        self._computed_locally.discard(request.request_id)
        if params.get("do_remote_prefill"):
            # Decode finished it before update_state_after_alloc (aborted while waiting): tell
            # prefill to free its blocks now rather than at the lease.
            params["do_remote_prefill"] = False
            try:
                remote = _parse_remote(params, self.block_size, len(self.groups))
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
        # FINISHED_REPETITION (newer vLLM) ends a prompt as normally as a stop or a length cap.
        normal = {RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED}
        repetition = getattr(RequestStatus, "FINISHED_REPETITION", None)
        if repetition is not None:
            normal.add(repetition)
        if request.status not in normal or len(block_ids) != len(self.groups):
            return False, None  # aborted (or another allocator's blocks): nothing to hand over
        # Decode reads the prompt's KV only: attention groups' blocks past the prompt (a prefill
        # that generated more than one token) would shift decode's prefix, so they stay out.
        prompt_blocks = -(-int(request.num_prompt_tokens) // self.block_size)
        lists = [_clip(g, [int(b) for b in block_ids[g.index]][
            :None if g.kind == "mamba" else prompt_blocks]) for g in self.groups]
        full = lists[self.full]
        if not full:
            return False, None  # nothing computed
        room = next(self._rooms)
        states = [ids for g, ids in zip(self.groups, lists) if g.index != self.full]
        self._to_send[request.request_id] = _SendReq(room, full, states)
        out: Dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(full),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.settings.bootstrap_host,
            "remote_port": self.settings.bootstrap_port,
            "tp_size": self.tp_size,
            "remote_num_tokens": int(request.num_prompt_tokens),
            _ROOM_KEY: room,
            _BLOCK_SIZE_KEY: self.block_size,
        }
        if len(self.groups) > 1:
            out[_GROUPS_KEY] = [len(ids) for ids in lists]
        return True, out

    def shutdown(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None


# ---------------------------------------------------------------------------------------------
# KV cache tensors -> pdlib buffers (the derivation itself: pdlib/_vllm_layout.py)

_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
                "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8",
                "uint8": "uint8"}


@dataclasses.dataclass
class KVCacheDescription:
    """This rank's KV cache as pdlib registers it: the full-attention group's layers as pdlib's
    KV pages (`kv`) and one state family per other group (`states`: (kind, buffers, the
    group's layout or None for Mamba)). Built by describe_kv_caches."""

    kv: _layout.KVLayoutDescription
    groups: List[_Group]
    states: List[Tuple[str, List[Tuple[int, int, int]], Optional[_layout.KVLayoutDescription]]]
    kv_dtype: str
    is_cuda: bool
    device_id: int

    @property
    def is_mla(self) -> bool:
        return self.kv.layer.kind == "mla"

    @property
    def blocks_per_block(self) -> int:
        return self.kv.layer.blocks_per_block


def _geometry(group: _Group, num_blocks: int, model_config: Any, tp_size: int) -> _layout.Geometry:
    spec = group.spec
    if spec is not None and hasattr(spec, "num_kv_heads"):
        mla = "MLAAttentionSpec" in _spec_names(spec) or \
            "SlidingWindowMLASpec" in _spec_names(spec)
        return _layout.Geometry(num_blocks, group.block_size, int(spec.num_kv_heads),
                                int(spec.head_size), mla)
    mla = bool(getattr(model_config, "use_mla", False))
    heads = 1 if mla else max(1, int(model_config.get_total_num_kv_heads()) // tp_size)
    return _layout.Geometry(num_blocks, group.block_size, heads,
                            int(model_config.get_head_size()), mla)


def describe_kv_caches(kv_caches: Dict[str, Any], groups: List[_Group], num_blocks: int,
                       model_config: Any, tp_size: int) -> KVCacheDescription:
    """register_kv_caches' tensors, by group (a layer no group names goes with full attention;
    a config without groups is one full group). Layouts are read off each tensor's shape and
    strides against its group's spec (_vllm_layout.describe_layers); anything pdlib cannot move
    is refused naming the shape, the strides and what pdlib would need."""
    if not kv_caches:
        raise ValueError("pdlib.vllm: register_kv_caches got no KV cache tensors")
    infos = {name: _layout.TensorInfo.of(name, t) for name, t in kv_caches.items()}
    owner: Dict[str, int] = {}
    for g in groups:
        for name in g.layer_names:
            owner.setdefault(name, g.index)
    full = next(g for g in groups if g.kind == "full")
    by_group: Dict[int, List[_layout.TensorInfo]] = {g.index: [] for g in groups}
    for name, info in infos.items():
        by_group[owner.get(name, full.index)].append(info)
    kv = _layout.describe_layers(by_group[full.index],
                                 _geometry(full, num_blocks, model_config, tp_size))
    states: List[Tuple[str, List[Tuple[int, int, int]],
                       Optional[_layout.KVLayoutDescription]]] = []
    for g in groups:
        if g.index == full.index:
            continue
        if not by_group[g.index]:
            raise ValueError(f"pdlib.vllm: KV cache group {g.index} ({g.kind}) has no tensor "
                             "among those register_kv_caches got")
        if g.kind == "mamba":
            states.append(("mamba", _layout.describe_state_pages(
                by_group[g.index], num_blocks, int(g.spec.page_size_bytes)), None))
        else:
            d = _layout.describe_layers(by_group[g.index],
                                        _geometry(g, num_blocks, model_config, tp_size))
            if d.layer.blocks_per_block != 1:
                raise ValueError(f"pdlib.vllm: sliding-window group {g.index} with kernel "
                                 "blocks smaller than its blocks is not supported")
            states.append(("swa", list(d.buffers), d))
    first = next(iter(kv_caches.values()))
    is_cuda = bool(getattr(first, "is_cuda", False))
    return KVCacheDescription(kv, groups, states, _DTYPE_NAMES.get(kv.dtype, ""), is_cuda,
                              int(first.device.index or 0) if is_cuda else 0)


# ---------------------------------------------------------------------------------------------
# Worker half


@dataclasses.dataclass
class _Receiving:
    receiver: Any
    local_block_ids: List[int]  # every vLLM block the load writes, every group
    started: float
    aborted: bool = False  # vLLM finished the request while it loaded
    abort_sent: bool = False
    initialized: bool = False  # receiver.init() took the pages (invalid_pages() covers them)
    kv_block_ids: List[int] = dataclasses.field(default_factory=list)  # full group's


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
        self.groups = _groups(kv_cache_config, vllm_config)
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
        self.failed_recving: Set[str] = set()  # of the last get_finished

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        d = describe_kv_caches(kv_caches, self.groups, self.num_blocks, self.model_config,
                               self.tp_size)
        lay = d.kv.layer
        total_heads = 1 if d.is_mla else int(self.model_config.get_total_num_kv_heads())
        if not d.is_mla and lay.heads != max(1, total_heads // self.tp_size):
            raise ValueError(
                f"pdlib.vllm: the KV cache holds {lay.heads} heads on TP rank {self.tp_rank} of "
                f"{self.tp_size}, the model has {total_heads} KV heads (expected "
                f"{max(1, total_heads // self.tp_size)} per rank)")
        self.description = d
        if self.producer:
            self.prefill = pdlib.KVManager.create(self._options(pdlib.Mode.Prefill, d,
                                                                total_heads))
        if self.consumer:
            self.decode = pdlib.KVManager.create(self._options(pdlib.Mode.Decode, d,
                                                               total_heads))
        logger.info("pdlib.vllm: TP rank %d/%d registered %d KV buffers (%d layers, %s) and %d "
                    "state families", self.tp_rank, self.tp_size, len(d.kv.buffers),
                    d.kv.num_layers, d.kv.page_layout, len(d.states))

    def _options(self, mode: Any, d: KVCacheDescription, total_heads: int) -> Any:
        s = self.settings
        lay = d.kv.layer
        o = pdlib.KVManagerOptions(mode=mode, backend=s.backend,
                                   backend_options=dict(s.backend_options))
        for ptr, nbytes, item in d.kv.buffers:
            o.args.kv.add(ptr, item, nbytes)
        o.args.page_size = lay.kernel_block_size
        o.args.is_mla = d.is_mla
        # Heads are sliced per page where a head range of a page is one piece per page (HND) or
        # per token (NHD): the packed and K/V-first layouts. Other pages (K then V of every
        # head, padded, or every layer of a block) move whole, between equal TP only.
        o.args.kv_head_num = lay.heads if d.kv.sliceable and not d.is_mla else 0
        o.args.kv_layout = pdlib.KVLayout.NHD if lay.order == "NHD" else pdlib.KVLayout.HND
        o.args.parallel = pdlib.ParallelConfig(tp_size=self.tp_size, tp_rank=self.tp_rank)
        o.args.memory_kind = pdlib.MemoryKind.Cuda if d.is_cuda else pdlib.MemoryKind.Host
        o.args.device_id = d.device_id
        tags = ["vllm"]
        for kind, buffers, sd in d.states:
            family = pdlib.StateFamily(
                type=pdlib.StateType.Mamba if kind == "mamba" else pdlib.StateType.Swa)
            for ptr, nbytes, item in buffers:
                family.buffers.add(ptr, item, nbytes)
            n = len(buffers)
            # Split across TP ranks along the item's first dimension: by head where a window
            # page is head-major (HND), by token row then head (NHD); Mamba pages (conv and SSM
            # state of this rank's heads, packed) by bytes, which pairs ranks of equal TP only:
            # the engine tag below refuses unequal TP for them.
            family.dim_per_tensor = [0] * n
            family.item_rows = [1] * n
            family.split_units = [0] * n
            if sd is not None and sd.sliceable:
                if sd.layer.order == "NHD":
                    family.dim_per_tensor = [1] * n
                    family.item_rows = [sd.layer.kernel_block_size] * n
                family.split_units = [total_heads] * n
            else:
                tags.append(f"{kind} state by rank: attention TP {self.tp_size}")
            o.args.state_families.append(family)
        kv_dtype = _DTYPE_NAMES.get(d.kv.dtype, "")
        if self.cache_dtype.startswith("fp8"):
            kv_dtype = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                        "fp8_e5m2": "fp8_e5m2"}.get(self.cache_dtype, "")
        groups = ",".join(g.kind for g in d.groups)
        o.args.fingerprint = pdlib.ModelFingerprint(
            num_layers=len(d.kv.buffers) // (2 if lay.kind == "kv_split" else 1),
            num_kv_heads=1 if d.is_mla else total_heads,
            head_dim=lay.row_elements, dtype_bytes=d.kv.element_size,
            model_name=str(getattr(self.model_config, "model", "") or ""), kv_dtype=kv_dtype,
            page_layout=f"{d.kv.page_layout}-{d.kv.num_layers}layers-page{lay.kernel_block_size}"
                        f"-groups:{groups}",
            engine_tag="; ".join(tags))
        o.direction = pdlib.TransferDirection.Pull
        o.pull_lease = s.pull_lease
        o.bootstrap_host, o.bootstrap_port = s.bootstrap_host, s.bootstrap_port
        o.listen_host = s.listen_host
        o.liveness_timeout = s.liveness_timeout
        o.connect_timeout = s.connect_timeout
        o.auth_secret = s.auth_secret
        o.checksum = s.checksum
        o.checksum_sample_every = s.checksum_sample_every
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
        k = self.description.blocks_per_block if self.description is not None else 1
        pages = _layout.expand_blocks(send.block_ids, k)
        states = [np.asarray(ids, dtype=np.int32) for ids in send.state_ids] or None
        try:
            sender.init(len(pages), None)
            sender.send(np.asarray(pages, dtype=np.int32), True, states)
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
                self._fail_now(req_id, recv.all_block_ids)
            return
        if recv.error is not None:
            logger.error("pdlib.vllm: request %s (room %d): %s", req_id, recv.room, recv.error)
            self._fail_now(req_id, recv.all_block_ids)
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
                self._fail_now(req_id, recv.all_block_ids)
            return
        k = self.description.blocks_per_block if self.description is not None else 1
        states = [np.asarray(ids, dtype=np.int32) for ids in recv.state_ids] or None
        initialized = False
        try:
            receiver.init(np.asarray(_layout.expand_blocks(recv.local_block_ids, k),
                                     dtype=np.int32), None, states,
                          decode_prefix_len=prefix_blocks * self.block_size)
            initialized = True
        except (pdlib.Error, TypeError, ValueError) as e:
            # The room may have failed before init() (a refused pairing, a dead prefill):
            # pdlib then holds no pages for it, so every block is reported, not invalid_pages().
            logger.error("pdlib.vllm: request %s (room %d): %s", req_id, recv.room, e)
            receiver.abort(f"init failed: {e}")
        if recv.release_only:
            self._releasing.append(receiver)
        else:
            self._recving[req_id] = _Receiving(receiver, recv.all_block_ids, time.monotonic(),
                                               initialized=initialized,
                                               kv_block_ids=list(recv.local_block_ids))

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
        self.failed_recving = set()
        for req_id, r in list(self._recving.items()):
            if r.receiver is None:
                done_recving.add(req_id)
                self.failed_recving.add(req_id)
                del self._recving[req_id]
                continue
            state = r.receiver.poll()
            if state == pdlib.KVPoll.Success:
                pass
            elif state == pdlib.KVPoll.Failed and r.receiver.pages_reusable():
                invalid = self._load_errors(r)
                if not r.aborted:
                    self.failed_recving.add(req_id)
                    logger.warning("pdlib.vllm: request %s: loading its KV failed (%d of %d "
                                   "blocks not loaded): %s", req_id, len(invalid),
                                   len(r.local_block_ids), r.receiver.failure_reason())
                    with self._lock:
                        self._invalid.update(invalid)
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

    def _load_errors(self, r: _Receiving) -> List[int]:
        """The vLLM blocks a failed load reports. pull's invalid_pages() names the pages of
        init() whose reads did not all complete (the others hold every byte); it does not cover
        state, and it is empty for a room that failed before or at init(). So: those pages'
        blocks plus every state block, or every block of the load when pdlib cannot say."""
        if not r.initialized:
            return list(r.local_block_ids)
        k = self.description.blocks_per_block if self.description is not None else 1
        pages = {int(p) // k for p in r.receiver.invalid_pages()}
        if not pages:
            return list(r.local_block_ids)  # failed with every read done: cannot tell
        states = r.local_block_ids[len(r.kv_block_ids):]
        return sorted(pages) + list(states)

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


class PdlibConnector(KVConnectorBase_V1, _SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector over pdlib (decode pull). Built by vLLM's KVConnectorFactory in the
    scheduler process (role SCHEDULER) and in every worker (role WORKER); each call is forwarded
    to the half of its role."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
            raise ValueError("pdlib.vllm: pipeline parallelism is not supported yet")
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
        return self._sched().request_finished(request, (list(block_ids),))

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """SupportsHMA: one block list per KV cache group (vLLM keeps its hybrid allocator
        on)."""
        return self._sched().request_finished(request, tuple(block_ids))

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

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        """Newer vLLM's worker call in place of get_finished (base.py's
        KVConnectorTransferResults, upstream 7ba3df63, after 2026-08-14): the same sets, with
        the failed loads (also in finished_recving) in failed_recving."""
        sending, recving = self.get_finished(finished_req_ids)
        return _vllm_base.KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=set(self._work().failed_recving))

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
