"""KVArgs, KVManagerOptions and their parts as dataclasses (include/pdlib/kv_args.h).

Filled once per rank at start-up and read by KVManager.create(), which copies every field into
the C++ structs and keeps a reference to the options: the buffers added with
BufferFamily.add() (numpy arrays, torch tensors, KV pools) stay alive as long as the manager.
Durations are seconds (float), where C++ takes milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from ._enums import (ControlPlane, Discovery, KvChecksum, KVLayout, MemoryKind, Mode, StateType,
                     TransferDirection)
from ._errors import InvalidArgumentError


def buffer_address(buffer: Any, nbytes: Optional[int] = None) -> Tuple[int, int, bool]:
    """(address, length in bytes, is_cuda) of a buffer pdlib may register.

    Accepts a raw address (int, with nbytes), a torch tensor (CPU or CUDA, through data_ptr()),
    anything exposing __cuda_array_interface__ or __array_interface__ (numpy arrays, cupy), or an
    object with the buffer protocol (KVPool, bytearray, memoryview). The memory must be one
    C-contiguous block; a strided view is refused, since pdlib would write past its elements.
    """
    if isinstance(buffer, bool):
        raise TypeError("buffer: expected an address, an array, a tensor or a buffer, got bool")
    if isinstance(buffer, int):
        if nbytes is None:
            raise TypeError("buffer: a raw address needs nbytes")
        if buffer <= 0 or buffer >= 1 << 64:
            raise ValueError(f"buffer: address {buffer:#x} is not a valid pointer")
        return buffer, _check_nbytes(nbytes), False
    data_ptr = getattr(buffer, "data_ptr", None)
    if callable(data_ptr) and hasattr(buffer, "is_contiguous"):  # torch.Tensor
        if not buffer.is_contiguous():
            raise ValueError("buffer: torch tensor is not contiguous (call .contiguous())")
        length = buffer.numel() * buffer.element_size()
        return int(data_ptr()), _limit(length, nbytes), bool(getattr(buffer, "is_cuda", False))
    for attr, cuda in (("__cuda_array_interface__", True), ("__array_interface__", False)):
        iface = getattr(buffer, attr, None)
        if iface is None:
            continue
        if iface.get("strides") is not None and not _c_contiguous(buffer):
            raise ValueError("buffer: array is not C-contiguous (use numpy.ascontiguousarray)")
        itemsize = int(iface["typestr"][2:])
        count = 1
        for dim in iface["shape"]:
            count *= int(dim)
        return int(iface["data"][0]), _limit(count * itemsize, nbytes), cuda
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"buffer: cannot take the address of a {type(buffer).__name__}; pass an int address"
            " with nbytes, a numpy array, a torch tensor or a KVPool"
        ) from None
    with view:
        if not view.c_contiguous:
            raise ValueError("buffer: memory is not C-contiguous")
        if view.readonly:
            raise ValueError("buffer: memory is read-only")
        import ctypes

        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
        return address, _limit(view.nbytes, nbytes), False


def _c_contiguous(array: Any) -> bool:
    flags = getattr(array, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            pass
    is_contiguous = getattr(array, "is_c_contiguous", None)  # cupy
    return bool(is_contiguous()) if callable(is_contiguous) else False


def _check_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
    return nbytes


def _limit(length: int, nbytes: Optional[int]) -> int:
    if nbytes is None:
        return length
    _check_nbytes(nbytes)
    if nbytes > length:
        raise ValueError(f"nbytes {nbytes} is larger than the buffer ({length} bytes)")
    return nbytes


@dataclasses.dataclass
class BufferFamily:
    """One family of registered buffers (KV, aux or state): entry i is buffer i's address,
    length and item size (a page for KV, a row for aux, a slot for state)."""

    ptrs: List[int] = dataclasses.field(default_factory=list)
    lens: List[int] = dataclasses.field(default_factory=list)
    item_lens: List[int] = dataclasses.field(default_factory=list)
    # Objects whose memory the entries point into, kept alive with the manager.
    owners: List[Any] = dataclasses.field(default_factory=list, repr=False, compare=False)
    # True when add() saw CUDA memory (KVArgs.memory_kind is then inferred as Cuda).
    has_cuda: bool = dataclasses.field(default=False, repr=False, compare=False)

    def add(self, buffer: Any, item_len: Optional[int] = None, nbytes: Optional[int] = None
            ) -> "BufferFamily":
        """Appends a buffer (see buffer_address). item_len defaults to the bytes of one row of
        an array or tensor with two or more dimensions (buffer[0]): a page of a
        [pages, page_size, heads, dim] KV buffer, a slot of a state buffer."""
        address, length, cuda = buffer_address(buffer, nbytes)
        if item_len is None:
            shape = getattr(buffer, "shape", None)
            if shape is None or len(shape) < 2 or int(shape[0]) == 0:
                raise TypeError("item_len is needed for a buffer without a leading row dimension")
            item_len = length // int(shape[0])
        if isinstance(item_len, bool) or not isinstance(item_len, int) or item_len <= 0:
            raise ValueError(f"item_len: expected a positive int, got {item_len!r}")
        self.ptrs.append(address)
        self.lens.append(length)
        self.item_lens.append(item_len)
        if not isinstance(buffer, int):
            self.owners.append(buffer)
        self.has_cuda = self.has_cuda or cuda
        return self

    @classmethod
    def from_buffers(cls, buffers: List[Any], item_lens: Optional[List[int]] = None
                     ) -> "BufferFamily":
        family = cls()
        for i, buffer in enumerate(buffers):
            family.add(buffer, None if item_lens is None else item_lens[i])
        return family

    def __len__(self) -> int:
        return len(self.ptrs)


@dataclasses.dataclass
class StateFamily:
    """One family of per-request state buffers of a hybrid model (C++ pdlib::StateFamily): a
    kind, its buffers and how they split across TP ranks. KVArgs.state_families lists them; each
    request then passes one index list per family, in that order (a list of lists as
    state_indices).

    dim_per_tensor: per buffer, the item dimension split across TP ranks (-1: not split; empty:
    none is). item_rows / split_units: optional, per buffer, for a split dimension other than 0
    (the product of the dimensions before it) and its extent across all TP ranks (0: unknown).
    start: model-wide index, within this family, of this PP stage's first buffer."""

    type: StateType = StateType.Null
    buffers: BufferFamily = dataclasses.field(default_factory=BufferFamily)
    dim_per_tensor: List[int] = dataclasses.field(default_factory=list)
    item_rows: List[int] = dataclasses.field(default_factory=list)
    split_units: List[int] = dataclasses.field(default_factory=list)
    start: int = 0


@dataclasses.dataclass
class ParallelConfig:
    """How one side is parallelised and where this rank sits in it."""

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0


@dataclasses.dataclass
class ModelFingerprint:
    """The model's KV shape; both sides must agree on every field or they refuse to connect
    (model_name only when both set it). kv_dtype/state_dtype: one of pdlib.element_type_names()
    ("fp16", "bf16", "fp8_e4m3", ...) or ""; wire_version is pdlib's own (set by pdlib)."""

    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 0
    layout_version: int = 1
    model_name: str = ""
    kv_dtype: str = ""
    state_dtype: str = ""
    page_layout: str = ""
    engine_tag: str = ""


AUX_ROOM_BUFFER_AUTO = -2


@dataclasses.dataclass
class KVArgs:
    """The buffers and shapes of one rank (SPEC R3.1); see include/pdlib/kv_args.h."""

    kv: BufferFamily = dataclasses.field(default_factory=BufferFamily)
    aux: BufferFamily = dataclasses.field(default_factory=BufferFamily)
    aux_room_buffer: int = AUX_ROOM_BUFFER_AUTO
    state: BufferFamily = dataclasses.field(default_factory=BufferFamily)
    state_type: StateType = StateType.Null
    state_dim_per_tensor: List[int] = dataclasses.field(default_factory=list)
    state_item_rows: List[int] = dataclasses.field(default_factory=list)
    state_split_units: List[int] = dataclasses.field(default_factory=list)
    state_start: int = 0
    # Hybrid-model state, several families: one entry per family (each request then passes a
    # list of index lists, one per family in this order). One family: one entry here, or the
    # shorthand fields above (state ... state_start); both at once is refused by
    # KVManager.create(). (After the shorthand so that positional KVArgs(...) keep meaning.)
    state_families: List[StateFamily] = dataclasses.field(default_factory=list)
    page_size: int = 1
    kv_head_num: int = 0
    kv_layout: KVLayout = KVLayout.HND
    is_mla: bool = False
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    prefill_start_layer: int = 0
    device_id: int = 0
    # None: Cuda when a buffer added through BufferFamily.add() is CUDA memory, else Host.
    memory_kind: Optional[MemoryKind] = None
    nic_names: List[str] = dataclasses.field(default_factory=list)
    fingerprint: ModelFingerprint = dataclasses.field(default_factory=ModelFingerprint)

    def resolved_memory_kind(self) -> MemoryKind:
        if self.memory_kind is not None:
            return MemoryKind(self.memory_kind)
        cuda = self.kv.has_cuda or self.aux.has_cuda or self.state.has_cuda or any(
            f.buffers.has_cuda for f in self.state_families)
        return MemoryKind.Cuda if cuda else MemoryKind.Host


@dataclasses.dataclass
class KVManagerOptions:
    """Options of one KVManager; the defaults are what a deployment should start from."""

    mode: Mode = Mode.Prefill
    args: KVArgs = dataclasses.field(default_factory=KVArgs)
    control_plane: ControlPlane = ControlPlane.Grpc
    backend: str = "fake"
    backend_options: Dict[str, str] = dataclasses.field(default_factory=dict)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    start_bootstrap_server: bool = False
    liveness_timeout: float = 5.0
    connect_timeout: float = 5.0
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 300.0
    transfer_timeout: float = 60.0
    quarantine_warn_after: float = 30.0
    auth_secret: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    transfer_workers: int = 2
    room_log_every: int = 0
    failure_injection_prob: float = -1.0
    failure_injection_stages: str = ""
    # Discovery.Etcd: prefill ranks register in etcd (no bootstrap server); see the README.
    discovery: Discovery = Discovery.BootstrapServer
    etcd_endpoints: List[str] = dataclasses.field(default_factory=list)
    etcd_prefix: str = "/pdlib"
    etcd_username: str = ""
    etcd_password: str = ""
    etcd_tls_ca_file: str = ""
    etcd_tls_cert_file: str = ""
    etcd_tls_key_file: str = ""
    # Pull (issue #29): decode reads prefill's published pages; both sides must agree. Prefill
    # holds published pages for pull_lease seconds without word from decode (>= 1 s).
    direction: TransferDirection = TransferDirection.Push
    pull_lease: float = 30.0
    # KV integrity (issue #42, docs/reliability.md "KV integrity"): both sides must agree (the fingerprint
    # carries it). A mismatch fails the room DATA_LOSS and marks its pages invalid.
    checksum: KvChecksum = KvChecksum.Off
    checksum_sample_every: int = 64


def parse_bootstrap_address(address: Any) -> Tuple[str, int]:
    """"host:port", "[v6]:port" or (host, port) -> (host, port)."""
    if isinstance(address, tuple) and len(address) == 2:
        host, port = address
    elif isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise InvalidArgumentError(
                f"INVALID_ARGUMENT: bootstrap address '{address}' is not HOST:PORT", 3,
                f"bootstrap address '{address}' is not HOST:PORT")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        port = int(port_text)
    else:
        raise TypeError(f"bootstrap address: expected 'host:port' or (host, port), got {address!r}")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536:
        raise InvalidArgumentError(
            f"INVALID_ARGUMENT: bootstrap address {address!r}: port must be in [1, 65535]", 3,
            f"bootstrap address {address!r}: port must be in [1, 65535]")
    return host, port
