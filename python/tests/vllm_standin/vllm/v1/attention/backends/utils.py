"""vllm/v1/attention/backends/utils.py at jsboige/vllm 6adad087 (2026-08-14):
get_kv_cache_layout() (override, then VLLM_KV_CACHE_LAYOUT, then the connector's wish:
get_kv_connector_cache_layout, which asks the connector class's get_required_kvcache_layout and
defaults to NHD). The stand-in takes the connector's wish from the test engine, which reads it
the way kv_connector/utils.py does (_standin_set_layout: test harness only)."""

from __future__ import annotations

import os
from typing import Optional

_connector_layout: Optional[str] = None


def _standin_set_layout(layout: Optional[str]) -> None:
    global _connector_layout
    _connector_layout = layout


def get_kv_cache_layout() -> str:
    layout = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout is None:
        layout = _connector_layout or "NHD"
    assert layout in ("NHD", "HND")
    return layout
