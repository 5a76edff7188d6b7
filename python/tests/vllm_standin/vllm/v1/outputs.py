"""vllm/v1/outputs.py: KVConnectorOutput (the fields of the current upstream dataclass)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Set


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: Optional[Set[str]] = None
    finished_recving: Optional[Set[str]] = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: Set[int] = dataclasses.field(default_factory=set)
    expected_finished_count: int = 0
