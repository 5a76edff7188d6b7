"""vllm/v1/request.py at jsboige/vllm 6adad087 (2026-08-14): Request (the attributes the scheduler and a connector use;
upstream builds it from an EngineCoreRequest, kv_transfer_params from
sampling_params.extra_args) and RequestStatus."""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional

from vllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Optional[List[int]],
                 sampling_params: Optional[SamplingParams], pooling_params: Any,
                 client_index: int = 0, **kwargs: Any) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.status = RequestStatus.WAITING
        self.kv_transfer_params: Optional[Dict[str, Any]] = None
        if pooling_params is not None:
            self.max_tokens = 1
        else:
            assert sampling_params is not None and sampling_params.max_tokens is not None
            self.max_tokens = sampling_params.max_tokens
            if sampling_params.extra_args is not None:
                self.kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids or ())
        self._output_token_ids: List[int] = []
        self._all_token_ids: List[int] = list(prompt_token_ids or ())
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)
