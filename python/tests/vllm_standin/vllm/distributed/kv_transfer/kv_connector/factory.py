"""KVConnectorFactory.create_connector as upstream factory.py does it for an out-of-tree
connector: kv_connector_module_path is imported, kv_connector looked up in it, and the class
built with (config, role, kv_cache_config)."""

from __future__ import annotations

import importlib
from typing import Any


class KVConnectorFactory:
    @classmethod
    def create_connector(cls, config: Any, role: Any, kv_cache_config: Any) -> Any:
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        module = importlib.import_module(kv_transfer_config.kv_connector_module_path)
        connector_cls = getattr(module, kv_transfer_config.kv_connector)
        return connector_cls(config, role, kv_cache_config)
