"""vllm/sampling_params.py: SamplingParams (max_tokens, and extra_args, which carries a request's
kv_transfer_params into the engine)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional


@dataclasses.dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16
    extra_args: Optional[Dict[str, Any]] = None
