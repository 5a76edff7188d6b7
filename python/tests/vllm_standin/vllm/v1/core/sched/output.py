"""vllm/v1/core/sched/output.py: SchedulerOutput (the fields the connector and the worker mixin
read; upstream also carries the scheduled requests' data)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Set


@dataclasses.dataclass
class SchedulerOutput:
    num_scheduled_tokens: Dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: Set[str]
    kv_connector_metadata: Any = None
