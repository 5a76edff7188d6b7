"""pdlib: moves LLM KV cache from prefill to decode servers (Python API).

    import pdlib
    o = pdlib.KVManagerOptions(mode=pdlib.Mode.Prefill, backend="ucx")
    o.args.kv.add(k_cache)          # a torch tensor or numpy array per layer and K/V buffer
    o.args.aux = metadata.describe()
    o.args.page_size = 16
    manager = pdlib.KVManager.create(o)
    sender = manager.create_sender(room)
    if sender.poll() == pdlib.KVPoll.WaitingForInput:
        # decode may hold the prompt's first sender.decode_prefix_len tokens: send the rest
        sender.init(sender.pages_after_prefix(prompt_len), aux_slot)
        sender.send(pages_after_the_prefix, is_last_chunk=True)

Every class and function mirrors the C++ API of include/pdlib (see python/README.md for the
mapping); a failed call raises the pdlib.Error subclass of its status code. pdlib.sglang
adapts all of it to SGLang's disaggregation backend interface.
"""

from __future__ import annotations

import atexit
from typing import Any

from ._enums import (
    ControlPlane,
    Discovery,
    KVLayout,
    KVPoll,
    LogLevel,
    MemoryKind,
    MetadataField,
    Mode,
    StateType,
    StatusCode,
    TransferDirection,
    KvChecksum,
)
from ._errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    ClosedError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)
from ._options import (
    AUX_ROOM_BUFFER_AUTO,
    BufferFamily,
    KVArgs,
    KVManagerOptions,
    ModelFingerprint,
    ParallelConfig,
    StateFamily,
    buffer_address,
    parse_bootstrap_address,
)
from ._pdlib import (
    BootstrapServer,
    KVPool,
    KVReceiver,
    KVSender,
    MetadataBuffers,
    MetadataSlotAllocator,
    ProcessGroup,
    allocate_kv_pool,
    builtin_backends,
    element_type_bytes,
    element_type_names,
    get_log_level,
    in_process_group,
    list_backends,
    page_count,
    poll_and_all_reduce,
    render_prometheus,
    set_log_level,
    set_log_sink,
    token_indices_to_page_indices,
)
from ._pdlib import KVManager, _close_all_managers

__version__ = "0.2.0"


# Managers still open at interpreter exit are closed first: their threads must not outlive the
# objects (numpy arrays, tensors) whose memory they write, nor call a log sink into a Python
# that is shutting down.
def _close_all_at_exit() -> None:
    _close_all_managers()
    set_log_sink(None)


atexit.register(_close_all_at_exit)


class TorchProcessGroup:
    """Adapts a torch.distributed group to poll_and_all_reduce: a MIN all-reduce of the states
    through torch.distributed.all_reduce (gloo for CPU tensors; with NCCL pass device="cuda").

        group = pdlib.TorchProcessGroup(tp_group)          # None: the default group
        states = pdlib.poll_and_all_reduce(receivers, group)
    """

    def __init__(self, group: Any = None, device: str = "cpu"):
        import torch.distributed as dist

        self._dist: Any = dist  # torch.distributed: untyped for mypy
        self._group = group
        self._device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce_min(self, values: Any) -> Any:
        import torch

        tensor = torch.from_numpy(values)  # shares memory: the reduction lands in `values`
        if self._device != "cpu":
            tensor = tensor.to(self._device)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)
        return None if self._device == "cpu" else tensor.cpu().numpy()


def log_to_python_logging(logger_name: str = "pdlib") -> None:
    """Routes pdlib's log lines into the standard logging module (logger `logger_name`)."""
    import logging

    logger = logging.getLogger(logger_name)
    levels = {
        LogLevel.Debug: logging.DEBUG,
        LogLevel.Info: logging.INFO,
        LogLevel.Warning: logging.WARNING,
        LogLevel.Error: logging.ERROR,
    }

    def sink(level: LogLevel, file: str, line: int, message: str) -> None:
        logger.log(levels.get(level, logging.ERROR), "%s (%s:%d)", message, file, line)

    set_log_sink(sink)


# Spelled out, so that type checkers (mypy --strict) see what the package exports.
__all__ = [
    'AUX_ROOM_BUFFER_AUTO', 'AbortedError', 'AlreadyExistsError', 'BootstrapServer',
    'BufferFamily', 'CancelledError', 'ClosedError', 'ControlPlane', 'DataLossError', 'Discovery',
    'DeadlineExceededError', 'Error', 'FailedPreconditionError', 'InternalError',
    'InvalidArgumentError', 'KVArgs', 'KVLayout', 'KVManager', 'KVManagerOptions', 'KVPoll',
    'KVPool', 'KVReceiver', 'KVSender', 'LogLevel', 'MemoryKind', 'MetadataBuffers',
    'MetadataField', 'MetadataSlotAllocator', 'Mode', 'ModelFingerprint', 'NotFoundError',
    'OutOfRangeError', 'ParallelConfig', 'PermissionDeniedError', 'ProcessGroup',
    'ResourceExhaustedError', 'StateFamily', 'StateType', 'StatusCode', 'TorchProcessGroup',
    'TransferDirection',
    'KvChecksum',
    'UnauthenticatedError', 'UnavailableError', 'UnimplementedError', 'UnknownError',
    'allocate_kv_pool', 'buffer_address', 'builtin_backends', 'element_type_bytes', 'element_type_names',
    'get_log_level',
    'in_process_group', 'list_backends', 'log_to_python_logging', 'page_count',
    'parse_bootstrap_address', 'poll_and_all_reduce', 'render_prometheus', 'set_log_level',
    'set_log_sink', 'token_indices_to_page_indices',
]
