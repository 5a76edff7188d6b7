"""pdlib's enums as IntEnums with the C++ values (include/pdlib/types.h, status.h, log.h).

The values are part of the contract: KVPoll.Failed is 0 so that a MIN all-reduce across ranks
makes every rank agree on failure, and the C++ extension hands out these very members.
"""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    """Transfer state of one request on one rank; it only moves forward."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class Mode(enum.IntEnum):
    Prefill = 0
    Decode = 1


class StateType(enum.IntEnum):
    """The kind of a hybrid model's per-request state family (C++ pdlib::StateType)."""

    Null = 0  # "None" is a keyword-like name in Python; C++ kNone
    Mamba = 1  # recurrent state: one slot per request
    Swa = 2  # sliding-window attention: the pages inside the window
    Nsa = 3  # DeepSeek sparse attention index keys (SGLang "nsa"/"dsa"): one index per page
    MinimaxIndexK = 4  # MiniMax's index keys: full-sequence pages, as Nsa
    SwaRing = 5  # ring rows of a sliding window: as many rows as prefill sends
    C128State = 6  # one request-scoped slot, or none

    @property
    def type_name(self) -> str:
        """pdlib's name of the kind (C++ StateTypeName): "none", "mamba", "swa", "nsa",
        "minimax_index_k", "swa_ring", "c128_state"."""
        return _STATE_TYPE_NAMES[self.value]

    @classmethod
    def from_name(cls, name: str) -> "StateType":
        """The kind pdlib (or SGLang) calls `name`; "dsa" is SGLang's newer name for "nsa".
        ValueError for an unknown name."""
        key = "nsa" if name == "dsa" else name
        if key not in _STATE_TYPE_NAMES:
            raise ValueError(f"unknown state type '{name}'; pdlib knows "
                             + ", ".join(_STATE_TYPE_NAMES) + " and dsa")
        return cls(_STATE_TYPE_NAMES.index(key))


_STATE_TYPE_NAMES = ("none", "mamba", "swa", "nsa", "minimax_index_k", "swa_ring", "c128_state")


class MemoryKind(enum.IntEnum):
    Host = 0
    Cuda = 1


class KVLayout(enum.IntEnum):
    NHD = 0
    HND = 1


class ControlPlane(enum.IntEnum):
    Grpc = 0
    InProcess = 1


class Discovery(enum.IntEnum):
    """How prefill ranks are found: the bootstrap server (default) or etcd (etcd_endpoints)."""
    BootstrapServer = 0
    Etcd = 1


class TransferDirection(enum.IntEnum):
    """Which way KV moves (KVManagerOptions.direction, the same on both sides; C++
    pdlib::TransferDirection)."""

    Push = 0  # prefill writes into the pages decode named (decode's memory is exposed)
    Pull = 1  # prefill publishes its pages under a lease; decode reads them (prefill's is)

    @property
    def direction_name(self) -> str:
        """pdlib's name of the direction (C++ TransferDirectionName): "push" or "pull"."""
        return "pull" if self is TransferDirection.Pull else "push"


class KvChecksum(enum.IntEnum):
    """KV integrity (KVManagerOptions.checksum, the same on both sides; C++ pdlib::KvChecksum):
    a CRC32C digest of what each transfer moved, checked where it landed before Success."""

    Off = 0
    Sampled = 1  # 1 room in checksum_sample_every
    All = 2


class StatusCode(enum.IntEnum):
    Ok = 0
    Cancelled = 1
    Unknown = 2
    InvalidArgument = 3
    DeadlineExceeded = 4
    NotFound = 5
    AlreadyExists = 6
    PermissionDenied = 7
    ResourceExhausted = 8
    FailedPrecondition = 9
    Aborted = 10
    OutOfRange = 11
    Unimplemented = 12
    Internal = 13
    Unavailable = 14
    DataLoss = 15
    Unauthenticated = 16


class LogLevel(enum.IntEnum):
    Debug = 0
    Info = 1
    Warning = 2
    Error = 3
    Off = 4


class MetadataField(enum.IntEnum):
    """The fields of a metadata slot, in buffer order (SPEC R4.1)."""

    OutputIds = 0
    CachedTokens = 1
    OutputTokenLogprobsVal = 2
    OutputTokenLogprobsIdx = 3
    OutputTopLogprobsVal = 4
    OutputTopLogprobsIdx = 5
    OutputTopkP = 6
    OutputTopkIndex = 7
    OutputHiddenStates = 8
    BootstrapRoom = 9
