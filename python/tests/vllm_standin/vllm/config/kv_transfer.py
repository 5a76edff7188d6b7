"""vllm/config/kv_transfer.py @007c643b4abb: KVTransferConfig (a plain dataclass here, upstream
a pydantic one; same fields, same __post_init__ checks, same properties)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Dict, Optional

_PRODUCERS = ("kv_producer", "kv_both")
_CONSUMERS = ("kv_consumer", "kv_both")


@dataclasses.dataclass
class KVTransferConfig:
    kv_connector: Optional[str] = None
    engine_id: Optional[str] = None
    kv_buffer_device: Optional[str] = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: Optional[str] = None
    kv_rank: Optional[int] = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in _PRODUCERS + _CONSUMERS:
            raise ValueError(f"Unsupported kv_role: {self.kv_role}.")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("Please specify kv_disagg_role when kv_connector is set")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in _PRODUCERS

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in _CONSUMERS

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
