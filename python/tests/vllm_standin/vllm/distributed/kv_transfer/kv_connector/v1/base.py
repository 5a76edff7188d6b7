"""KVConnectorBase_V1 and SupportsHMA as upstream base.py defines them at jsboige/vllm 6adad087
(upstream main of 2026-08-14; the file last changed in d6941300f, 2026-08-09): the constructor,
the concrete metadata plumbing, the abstract methods and the defaults of the optional ones."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, Optional


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    pass


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class SupportsHMA(ABC):
    """The connector supports the hybrid memory allocator (one block list per group)."""

    @abstractmethod
    def request_finished_all_groups(self, request: Any, block_ids: tuple) -> tuple:
        raise NotImplementedError


def supports_hma(connector: Any) -> bool:
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorBase_V1(ABC):

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is not None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
        else:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # Worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict) -> None:
        return

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    @abstractmethod
    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set) -> tuple:
        return None, None

    def get_block_ids_with_load_errors(self) -> set:
        return set()

    def shutdown(self) -> None:
        return None

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None

    def build_connector_worker_meta(self) -> Any:
        return None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return

    # Scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        pass

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        pass

    def on_new_request(self, request: Any) -> None:
        return

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(self, request: Any, block_ids: list) -> tuple:
        return False, None

    def take_events(self) -> tuple:
        return ()

    def has_pending_push_work(self) -> bool:
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called on the abstract "
                            "base class")
        return None

    def get_finished_count(self) -> Optional[int]:
        return None

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(f"{type(self).__name__} received pp_rank > 0 handshake metadata "
                             "but does not support PP-disaggregated KV transfer.")
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    def reset_cache(self) -> Optional[bool]:
        return None
