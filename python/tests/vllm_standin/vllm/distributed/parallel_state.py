"""vllm.distributed.parallel_state: the two functions NixlConnector's worker (and pdlib's) calls.
Upstream they read the TP group set up by initialize_model_parallel(); the stand-in keeps the
rank of the worker being built, set by the test engine before it builds each worker
(_standin_set_tp: test harness only, no upstream counterpart)."""

from __future__ import annotations

_tp = (0, 1)


def _standin_set_tp(rank: int, size: int) -> None:
    global _tp
    _tp = (rank, size)


def get_tensor_model_parallel_rank() -> int:
    return _tp[0]


def get_tensor_model_parallel_world_size() -> int:
    return _tp[1]
