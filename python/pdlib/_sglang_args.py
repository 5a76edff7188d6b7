"""SGLang's KVArgs and server_args -> pdlib.KVManagerOptions (used by pdlib.sglang).

SGLang builds its KVArgs (sglang/srt/disaggregation/base/conn.py) with only the attributes its
schedulers set (prefill.py / decode.py `_init_kv_manager`, utils.py `setup_state_kv_args`):
decode sets no head counts and no prefill_start_layer. Everything here reads those attributes
by name with getattr and a default, so the adapter needs nothing pdlib-specific on KVArgs or
server_args; pdlib's own knobs come from the environment (ENV_DOC below, python/README.md).

The two sides of a deployment build their fingerprints independently and must end up with the
same one. The per-rank KV head count is derived from the model's config.json (server_args.
model_path) on both sides; without a config the KV pages are moved whole (pdlib's opaque pages),
which needs equal attention TP, and the fingerprint's engine_tag names what is missing so that a
mixed pair is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import socket
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pdlib

logger = logging.getLogger("pdlib.sglang")

# pdlib's own settings for SGLang, all optional (python/README.md "Environment").
ENV_DOC: Dict[str, str] = {
    "PDLIB_SGLANG_BACKEND": "transport backend (ucx, verbs, fake, ...); default ucx when built",
    "PDLIB_SGLANG_BACKEND_OPTIONS": "backend options, k=v,k=v (e.g. "
                                    "ucx.tls=rc,ucx.net_devices=mlx5_0:1)",
    "PDLIB_SGLANG_KV_PAGES": "auto | by_head | whole: how KV pages are described (auto: by head "
                             "when the model config is found, else whole pages)",
    "PDLIB_SGLANG_TOTAL_KV_HEADS": "the model's KV heads, when the config cannot be read",
    "PDLIB_SGLANG_NUM_LAYERS": "the model's KV layers, for prefill PP > 1 without a config",
    "PDLIB_SGLANG_MODEL_NAME": "a name both sides must agree on (fingerprint model_name)",
    "PDLIB_SGLANG_MEMORY_KIND": "host | cuda: where the KV pools live (default from "
                                "server_args.device)",
    "PDLIB_SGLANG_LISTEN_HOST": "the address this prefill rank listens on and registers",
    "PDLIB_SGLANG_BOOTSTRAP_HOST": "the bootstrap server this prefill rank registers with",
    "PDLIB_SGLANG_AUX_ROOM_BUFFER": "index of the aux buffer holding bootstrap_room (default: "
                                    "the last, as in SGLang's MetadataBuffers)",
    "PDLIB_SGLANG_LIVENESS_TIMEOUT": "seconds (default: SGLang's heartbeat interval x failures)",
    "PDLIB_SGLANG_CONNECT_TIMEOUT": "seconds (pdlib's default 5)",
    "PDLIB_SGLANG_TRANSFER_TIMEOUT": "seconds (pdlib's default 60)",
    "PDLIB_SGLANG_RELEASE_WAIT": "seconds clear() waits for pages another rank's failure left "
                                 "in flight (default 30)",
    "PDLIB_SGLANG_CHECKSUM": "off | sampled | all: pdlib's end-to-end KV digest (default off; "
                             "docs/reliability.md \"KV integrity\"); the same on both sides",
    "PDLIB_SGLANG_CHECKSUM_SAMPLE_EVERY": "with sampled: 1 request in this many (default 64)",
}

def checksum_setting(mode: str, every: str, what: str) -> Tuple[pdlib.KvChecksum, int]:
    """pdlib's KV checksum setting from its text form ("off", "sampled", "all")."""
    modes = {"off": pdlib.KvChecksum.Off, "sampled": pdlib.KvChecksum.Sampled,
             "all": pdlib.KvChecksum.All}
    key = str(mode).strip().lower()
    if key not in modes:
        raise ConfigError(f"{what}={mode!r}: off, sampled or all")
    if not str(every).strip().isdigit() or int(every) < 1:
        raise ConfigError(f"{what}: a sample of 1 in {every!r} requests: a whole number >= 1")
    return modes[key], int(every)


# SGLang's StateType values (base/conn.py) -> pdlib's kinds. The others have index layouts or TP
# splits pdlib does not describe; a KVArgs that carries one is refused with the reason.
_STATE_KINDS: Dict[str, pdlib.StateType] = {
    "mamba": pdlib.StateType.Mamba,
    "swa": pdlib.StateType.Swa,
    "dsa": pdlib.StateType.Nsa,
    "nsa": pdlib.StateType.Nsa,
    "minimax_index_k": pdlib.StateType.MinimaxIndexK,
    "swa_ring": pdlib.StateType.SwaRing,
    "c128_state": pdlib.StateType.C128State,
}
_UNSUPPORTED_STATES: Dict[str, str] = {
    "qsa_pending": "a per-request compression ring addressed by request-pool slot",
    "qsa_compressed": "compressed KV pages whose TP split pdlib does not know",
    "dsa_tail": "a ring row whose indices encode a live subrange",
    "minimax_dense_kv": "dense index-value pages whose TP split pdlib does not know",
    "block_scale": "per-block KV scales whose TP split pdlib does not know",
    "block_scale_swa": "per-block SWA KV scales whose TP split pdlib does not know",
}

# SGLang's kv_cache_dtype / dtype names -> pdlib's element type names.
_DTYPE_NAMES = {
    "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp32": "fp32", "float32": "fp32",
    "float": "fp32", "int8": "int8", "uint8": "uint8",
}

# The fingerprint's engine_tag (compared by pdlib; a mismatch names both): how the KV pages are
# described. Whole pages carry the attention TP, since they need it equal on both sides.
_TAG_BY_HEAD = "sglang: KV pages by head"
_TAG_WHOLE = "sglang: KV pages whole (no model config): attn TP {tp}"


class ConfigError(ValueError):
    """SGLang's arguments describe something pdlib cannot move; the message says what to do."""


def env_str(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value else None


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError as e:
        raise ConfigError(f"{name}={value!r} is not a number") from e


def _get(obj: Any, name: str, default: Any = None) -> Any:
    value = getattr(obj, name, None) if obj is not None else None
    return default if value is None else value


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass
class Layout:
    """What the adapter keeps from the translation besides the options."""

    mode: str  # "prefill" | "decode"
    attn_tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    kv_pages: str  # "by_head" | "whole" | "mla"
    families: List[str]  # SGLang's state type names, in order
    kv_page_bytes: int  # sum of this rank's KV item lens: bytes of one page across buffers
    aux_row_bytes: int
    state_item_bytes: List[int]  # per family: sum of item lens
    notes: List[str]
    why_whole: str = ""  # kv_pages "whole": why


def model_config(server_args: Any) -> Tuple[Optional[Dict[str, Any]], str]:
    """The model's config.json as a dict (its text_config for a multimodal model), and where it
    was looked for. server_args.model_path is a local directory, or a Hugging Face id whose
    config is in the local cache (never downloaded here)."""
    path = _get(server_args, "model_path", None)
    if not path:
        return None, "server_args.model_path is not set"
    path = str(path)
    candidates = [os.path.join(path, "config.json")] if os.path.isdir(path) else []
    if not candidates:
        try:
            hub = importlib.import_module("huggingface_hub")
            cached = hub.try_to_load_from_cache(path, "config.json",
                                                revision=_get(server_args, "revision", None))
            if isinstance(cached, str):
                candidates.append(cached)
        except Exception:  # noqa: BLE001 - no hub, or not cached: no config
            pass
    for candidate in candidates:
        try:
            with open(candidate, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            text = config.get("text_config") or config.get("llm_config")
            if isinstance(text, dict) and not _config_kv_heads(config):
                config = {**config, **text}
            return config, candidate
    return None, f"no readable config.json for model_path {path!r}"


def _config_kv_heads(config: Dict[str, Any]) -> Optional[int]:
    """The model's KV heads before TP, by the names model configs use (as SGLang's
    ModelConfig.get_total_num_kv_heads)."""
    attn = config.get("attn_config")
    if isinstance(attn, dict) and attn.get("kv_n_heads"):
        return int(attn["kv_n_heads"])
    for key in ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num"):
        if config.get(key):
            return int(config[key])
    if config.get("multi_query"):
        return 1
    for key in ("num_attention_heads", "n_head", "n_heads"):
        if config.get(key):
            return int(config[key])
    return None


def _hold(total: int, tp: int) -> Optional[int]:
    """KV heads one of `tp` ranks holds (pdlib's and SGLang's rule; replicated when tp > total),
    or None when the two do not divide."""
    if total >= tp:
        return total // tp if total % tp == 0 else None
    return 1 if tp % total == 0 else None


def _dtype_name(args: Any, server_args: Any) -> str:
    for value in (_get(args, "kv_cache_dtype_str", None),
                  _get(server_args, "kv_cache_dtype", None)):
        if value and str(value) != "auto":
            return _DTYPE_NAMES.get(str(value).lower(), "")
    legacy = str(_get(args, "kv_dtype", ""))  # the adapter's older KVArgs field
    return legacy if legacy in pdlib.element_type_names() else ""


def _local_ip(toward: str) -> str:
    """This host's address on the route to `toward` (no packet is sent), else by hostname."""
    for target in (toward, "8.8.8.8"):
        if target in ("", "127.0.0.1", "localhost", "::1"):
            continue
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 80))
                address = str(s.getsockname()[0])
                if not address.startswith("127."):
                    return address
        except OSError:
            continue
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return "127.0.0.1"


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _hosts(server_args: Any) -> Tuple[str, str]:
    """(bootstrap host a prefill rank registers with, address it listens on and registers) as
    SGLang's CommonKVManager picks them: the dist_init_addr host on several nodes, else
    server_args.host with 0.0.0.0 -> 127.0.0.1; the rank's own routable address."""
    host = str(_get(server_args, "host", "127.0.0.1"))
    bootstrap = env_str("PDLIB_SGLANG_BOOTSTRAP_HOST")
    dist_init = _get(server_args, "dist_init_addr", None)
    if bootstrap is None:
        if dist_init and int(_get(server_args, "nnodes", 1)) > 1:
            bootstrap = str(dist_init).rsplit(":", 1)[0].strip("[]")
        else:
            bootstrap = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    listen = env_str("PDLIB_SGLANG_LISTEN_HOST") or env_str("SGLANG_HOST_IP")
    if listen is None:
        if _is_loopback(host):
            listen = "127.0.0.1" if host == "localhost" else host
        elif host not in ("0.0.0.0", "::", ""):
            listen = host
        else:
            listen = _local_ip(bootstrap)
    return bootstrap, listen


def _int_list(values: Any, what: str) -> List[int]:
    if values is None:
        return []
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"KVArgs.{what}: expected a list of integers, got {values!r}") from e


def _nth(values: Any, index: int) -> Any:
    if values is None:
        return None
    try:
        return values[index]
    except (IndexError, TypeError, KeyError):
        return None


def _state_families(args: Any, kv_pages: str, is_mla: bool, page_size: int,
                    heads_here: int, total_heads: int, pp_size: int
                    ) -> Tuple[List[pdlib.StateFamily], List[str], bool]:
    """pdlib's state families from SGLang's state_types and its nested per-component lists
    (utils.setup_state_kv_args / append_state_component). Returns the families, SGLang's names
    and whether a GDN conv state split in sub-blocks is present (pdlib cannot slice those
    across unequal TP)."""
    types = _get(args, "state_types", None)
    if types is None and _get(args, "state_type", None) not in (None, "none"):
        # The adapter's older single-family shape: state_type + flat state_* lists.
        types = [_get(args, "state_type")]
        ptrs = [_get(args, "state_data_ptrs", [])]
        lens = [_get(args, "state_data_lens", [])]
        items = [_get(args, "state_item_lens", [])]
        dims = [_get(args, "state_dim_per_tensor", [])]
    else:
        ptrs = _get(args, "state_data_ptrs", [])
        lens = _get(args, "state_data_lens", [])
        items = _get(args, "state_item_lens", [])
        dims = _get(args, "state_dim_per_tensor", [])
    types = list(types or [])
    outer = _get(args, "state_slice_outer_counts", [])
    conv = _get(args, "state_conv_shard_groups", [])
    families: List[pdlib.StateFamily] = []
    names: List[str] = []
    conv_split = False
    for f, st in enumerate(types):
        name = str(getattr(st, "value", st)).lower()
        if name in _UNSUPPORTED_STATES:
            raise ConfigError(
                f"KVArgs.state_types[{f}] is {name!r} ({_UNSUPPORTED_STATES[name]}): pdlib has no "
                "state kind for it; serve this model with another transfer backend (mooncake)")
        if name not in _STATE_KINDS:
            raise ConfigError(f"KVArgs.state_types[{f}] is {name!r}, which pdlib.sglang does not "
                              f"know (it knows {', '.join(sorted(_STATE_KINDS))})")
        if pp_size > 1:
            raise ConfigError(f"state component {name!r} with pipeline parallelism (pp_size "
                              f"{pp_size}): pdlib.sglang does not place state buffers across PP "
                              "stages; use pp_size 1")
        f_ptrs = _int_list(_nth(ptrs, f), f"state_data_ptrs[{f}]")
        f_lens = _int_list(_nth(lens, f), f"state_data_lens[{f}]")
        f_items = _int_list(_nth(items, f), f"state_item_lens[{f}]")
        if not (len(f_ptrs) == len(f_lens) == len(f_items)):
            raise ConfigError(f"state component {f} ({name}): {len(f_ptrs)} ptrs, {len(f_lens)} "
                              f"lens, {len(f_items)} item_lens")
        family = pdlib.StateFamily(type=_STATE_KINDS[name],
                                   buffers=pdlib.BufferFamily(f_ptrs, f_lens, f_items))
        n = len(f_ptrs)
        f_dims = _nth(dims, f) or []
        if f_dims and len(f_dims) == n:
            family.dim_per_tensor = [-1 if d is None else int(d) for d in f_dims]
        f_outer = _nth(outer, f) or []
        if family.dim_per_tensor and f_outer and len(f_outer) == n:
            family.item_rows = [max(1, int(o)) for o in f_outer]
        if any(g is not None for g in (_nth(conv, f) or [])):
            conv_split = True
        if (family.type == pdlib.StateType.Swa and not family.dim_per_tensor and not is_mla
                and kv_pages == "by_head"
                and all(i % (page_size * heads_here) == 0 for i in f_items)):
            # SWA pages are KV pages of the window's layers, [token][head][dim] per page, split
            # across TP by head like the KV pages themselves.
            family.dim_per_tensor = [1] * n
            family.item_rows = [page_size] * n
            family.split_units = [total_heads] * n
        families.append(family)
        names.append(name)
    return families, names, conv_split


def build(args: Any, mode: str, server_args: Any, is_mla_backend: bool
          ) -> Tuple[pdlib.KVManagerOptions, Layout]:
    """The manager options for SGLang's `args` on a `mode` ("prefill"/"decode") rank."""
    s = server_args
    notes: List[str] = []
    # ---- refusals of SGLang settings pdlib.sglang cannot serve, each with what to do
    if _get(s, "disaggregation_decode_allocation_policy", "early") == "prefill_complete":
        raise ConfigError("--disaggregation-decode-allocation-policy prefill_complete needs "
                          "SGLang's deferred bootstrap table, which pdlib does not implement; "
                          "use the default policy 'early'")
    if int(_get(s, "attn_cp_size", 1)) > 1:
        raise ConfigError(f"attention context parallelism (attn_cp_size {_get(s, 'attn_cp_size')})"
                          " is not supported by pdlib.sglang; use attn_cp_size 1")
    if _get(s, "enable_hisparse", False):
        raise ConfigError("HiSparse moves KV into host pools with their own page size, which "
                          "pdlib.sglang does not describe; disable --enable-hisparse")
    if mode == "decode" and _truthy(os.environ.get(
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK")):
        raise ConfigError("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK makes SGLang ask the "
                          "bootstrap server over HTTP for DP ranks; pdlib finds the prefill DP "
                          "rank itself (room % prefill dp_size, or the router's rank): unset it")
    device = str(_get(s, "device", "cpu")).lower()
    kind_env = env_str("PDLIB_SGLANG_MEMORY_KIND")
    legacy_kind = getattr(args, "memory_kind", None)
    if kind_env:
        if kind_env.lower() not in ("host", "cuda"):
            raise ConfigError(f"PDLIB_SGLANG_MEMORY_KIND={kind_env!r}: host or cuda")
        memory_kind = pdlib.MemoryKind.Cuda if kind_env.lower() == "cuda" else pdlib.MemoryKind.Host
    elif legacy_kind is not None:
        memory_kind = pdlib.MemoryKind(legacy_kind)
    elif device in ("cpu", "host"):
        memory_kind = pdlib.MemoryKind.Host
    elif device.startswith("cuda"):
        memory_kind = pdlib.MemoryKind.Cuda
    else:
        raise ConfigError(f"server_args.device is {device!r}: pdlib.sglang moves host or CUDA "
                          "memory (set PDLIB_SGLANG_MEMORY_KIND if the pools are one of those)")

    # ---- parallelism, as SGLang's attention groups see it
    tp_size = max(1, int(_get(s, "tp_size", 1)))
    dp_size = max(1, int(_get(s, "dp_size", 1)))
    pp_size = max(1, int(_get(s, "pp_size", 1)))
    attn_tp = tp_size // dp_size if _get(s, "enable_dp_attention", False) else tp_size
    attn_tp = max(1, attn_tp)
    tp_rank = int(_get(args, "engine_rank", 0)) % attn_tp
    dp_rank = int(_get(args, "system_dp_rank", 0)) % dp_size
    pp_rank = int(_get(args, "pp_rank", 0))

    is_mla = bool(is_mla_backend) or bool(_get(args, "is_hybrid_mla_backend", False))
    page_size = int(_get(args, "page_size", 1))
    kv_ptrs = _int_list(_get(args, "kv_data_ptrs", []), "kv_data_ptrs")
    kv_lens = _int_list(_get(args, "kv_data_lens", []), "kv_data_lens")
    kv_items = _int_list(_get(args, "kv_item_lens", []), "kv_item_lens")
    if not kv_ptrs or not (len(kv_ptrs) == len(kv_lens) == len(kv_items)):
        raise ConfigError(f"KVArgs: {len(kv_ptrs)} kv_data_ptrs, {len(kv_lens)} kv_data_lens, "
                          f"{len(kv_items)} kv_item_lens (at least one buffer, the same count)")
    kinds = 1 if is_mla else 2
    if len(kv_ptrs) % kinds:
        raise ConfigError(f"{len(kv_ptrs)} KV buffers: a non-MLA model has a K and a V buffer "
                          "per layer")
    num_draft = int(_get(args, "num_draft_entries", 0))
    target = len(kv_ptrs) - num_draft
    if num_draft < 0 or target <= 0 or num_draft % kinds or target % kinds:
        raise ConfigError(f"num_draft_entries {num_draft} of {len(kv_ptrs)} KV buffers: the "
                          "target's and the draft's K/V buffers must each come in pairs")

    # ---- the KV page description and the fingerprint's head counts
    config, config_where = model_config(s)
    requested = (env_str("PDLIB_SGLANG_KV_PAGES") or "auto").lower()
    if requested not in ("auto", "by_head", "whole"):
        raise ConfigError(f"PDLIB_SGLANG_KV_PAGES={requested!r}: auto, by_head or whole")
    total_env = env_str("PDLIB_SGLANG_TOTAL_KV_HEADS")
    total_cfg = _config_kv_heads(config) if config else None
    total_args = int(_get(args, "total_kv_head_num", 0))
    # SGLang gives head counts to prefill's KVArgs only, so they decide nothing by themselves
    # (both sides must decide alike): the config, the environment, or an engine of the
    # adapter's earlier shape (pdlib_* fields on server_args) that sets them on both sides.
    legacy = any(getattr(s, n, None) is not None for n in ("pdlib_backend",
                                                            "pdlib_backend_options"))
    use_args = legacy or requested == "by_head"
    total = int(total_env) if total_env else (total_cfg or (total_args if use_args else 0))
    if total_cfg and total_args and total_cfg != total_args and not total_env:
        raise ConfigError(f"the model config ({config_where}) says {total_cfg} KV heads, SGLang's "
                          f"KVArgs.total_kv_head_num {total_args}: set "
                          f"PDLIB_SGLANG_TOTAL_KV_HEADS={total_args} on both sides")
    heads_here = 0
    why = ""
    engine_tag = _TAG_BY_HEAD
    if is_mla:
        kv_pages = "mla"
        heads_here = 1
    elif requested == "whole" or (requested == "auto" and total <= 0):
        kv_pages = "whole"
        engine_tag = _TAG_WHOLE.format(tp=attn_tp)
        why = config_where if total <= 0 else "PDLIB_SGLANG_KV_PAGES=whole"
        notes.append(f"KV pages are moved whole ({why}); prefill and decode need equal attention "
                     "TP. Give both sides the model config (model_path) or "
                     "PDLIB_SGLANG_TOTAL_KV_HEADS for unequal TP")
    else:
        if total <= 0:
            raise ConfigError(f"PDLIB_SGLANG_KV_PAGES=by_head needs the model's KV heads: "
                              f"{config_where}; set PDLIB_SGLANG_TOTAL_KV_HEADS")
        kv_pages = "by_head"
        held = _hold(total, attn_tp)
        if held is None:
            raise ConfigError(f"{total} KV heads do not split over attention TP {attn_tp}")
        heads_here = held
        args_heads = int(_get(args, "kv_head_num", 0))
        if args_heads and args_heads != heads_here:
            raise ConfigError(f"SGLang's KVArgs.kv_head_num is {args_heads}, but {total} KV heads "
                              f"over attention TP {attn_tp} give {heads_here}")
        unit = page_size * heads_here
        bad = [i for i, item in enumerate(kv_items) if item % unit]
        if bad:
            raise ConfigError(f"KV buffer {bad[0]}: {kv_items[bad[0]]}-byte pages do not split "
                              f"into {page_size} tokens x {heads_here} heads (total {total} over "
                              f"attention TP {attn_tp}); check the model config or set "
                              "PDLIB_SGLANG_TOTAL_KV_HEADS")
        if num_draft and any(kv_items[i] != kv_items[0] for i in range(target, len(kv_items))):
            raise ConfigError(
                f"the draft model's KV pages ({kv_items[target]} bytes) differ from the target's "
                f"({kv_items[0]} bytes): pdlib.sglang cannot tell the draft's head layout. Run "
                "prefill and decode with equal attention TP and PDLIB_SGLANG_KV_PAGES=whole, or "
                "without speculative decoding")

    # ---- layers: this side's buffers, or the model's total with prefill PP
    layers = len(kv_ptrs) // kinds
    start_layer = 0
    if pp_size > 1:
        if mode == "decode":
            raise ConfigError(f"decode with pipeline parallelism (pp_size {pp_size}): SGLang "
                              "gives decode's KVArgs no stage start layer; run decode with "
                              "pp_size 1 (prefill may use PP)")
        if kv_pages == "whole":
            raise ConfigError("prefill pipeline parallelism needs the KV pages described by "
                              f"head: {config_where}; give model_path a config.json or set "
                              "PDLIB_SGLANG_TOTAL_KV_HEADS on both sides")
        if num_draft:
            raise ConfigError("draft-model KV buffers with prefill pipeline parallelism: "
                              "pdlib.sglang cannot place the draft layers; use pp_size 1")
        if _get(args, "mla_compression_ratios", None) or _get(args, "kv_layer_ids", None):
            raise ConfigError("prefill pipeline parallelism with a hybrid or compressed-MLA KV "
                              "pool: the per-stage buffer list is not one buffer per layer; "
                              "use pp_size 1")
        start_layer = int(_get(args, "prefill_start_layer", 0))
        stage_layers = len(kv_ptrs) // kinds
        end = _get(args, "prefill_end_layer", None)
        if end is not None and int(end) != start_layer + stage_layers:
            raise ConfigError(f"prefill PP stage {pp_rank}: layers [{start_layer}, {end}) but "
                              f"{stage_layers} KV layers registered")
        total_layers = env_str("PDLIB_SGLANG_NUM_LAYERS")
        if total_layers:
            layers = int(total_layers)
        elif config and config.get("num_hidden_layers"):
            layers = int(config["num_hidden_layers"])
        else:
            raise ConfigError(f"prefill PP needs the model's layer count: {config_where}; set "
                              "PDLIB_SGLANG_NUM_LAYERS")
        if start_layer + stage_layers > layers:
            raise ConfigError(f"prefill PP stage {pp_rank}: layers [{start_layer}, "
                              f"{start_layer + stage_layers}) outside the model's {layers}")

    kv_dtype = _dtype_name(args, s)
    elem = pdlib.element_type_bytes(kv_dtype) if kv_dtype else 1
    if kv_pages == "whole":
        head_dim = 0
        fp_heads = 0
        elem = 0 if not kv_dtype else elem
    else:
        head_bytes = kv_items[0] // (page_size * heads_here)
        if kv_dtype and head_bytes % elem:
            kv_dtype, elem = "", 1
        head_dim = head_bytes // elem
        fp_heads = 1 if is_mla else total

    families, names, conv_split = _state_families(args, kv_pages, is_mla, page_size, heads_here,
                                                  total, pp_size)
    if conv_split:
        # GDN conv states are three independently head-sharded blocks, which pdlib slices as one:
        # equal attention TP only, said in the fingerprint so that a mismatch names it.
        engine_tag = f"sglang: GDN conv state, attention TP {attn_tp} on both sides"

    # ---- options
    backend = _get(s, "pdlib_backend", None) or env_str("PDLIB_SGLANG_BACKEND")
    if backend is None:
        available = pdlib.list_backends()
        backend = "ucx" if "ucx" in available else ("verbs" if "verbs" in available else "fake")
        if backend == "fake":
            logger.warning("pdlib.sglang: no ucx or verbs backend built; using 'fake', which "
                           "moves no bytes (set PDLIB_SGLANG_BACKEND)")
    backend_options: Dict[str, str] = {}
    text = env_str("PDLIB_SGLANG_BACKEND_OPTIONS") or ""
    for item in text.split(","):
        if item.strip():
            if "=" not in item:
                raise ConfigError(f"PDLIB_SGLANG_BACKEND_OPTIONS: {item!r} is not key=value")
            key, value = item.split("=", 1)
            backend_options[key.strip()] = value.strip()
    backend_options.update(dict(_get(s, "pdlib_backend_options", {})))

    o = pdlib.KVManagerOptions(mode=pdlib.Mode.Prefill if mode == "prefill" else pdlib.Mode.Decode,
                               backend=str(backend), backend_options=backend_options)
    a = o.args
    a.kv = pdlib.BufferFamily(kv_ptrs, kv_lens, kv_items)
    aux_ptrs = _int_list(_get(args, "aux_data_ptrs", []), "aux_data_ptrs")
    aux_lens = _int_list(_get(args, "aux_data_lens", []), "aux_data_lens")
    aux_items = _int_list(_get(args, "aux_item_lens", []), "aux_item_lens")
    a.aux = pdlib.BufferFamily(aux_ptrs, aux_lens, aux_items)
    room_env = env_str("PDLIB_SGLANG_AUX_ROOM_BUFFER")
    if room_env is not None:
        a.aux_room_buffer = int(room_env)
    elif aux_ptrs:
        a.aux_room_buffer = aux_room_buffer(aux_ptrs)
    a.state_families = families
    a.page_size = page_size
    a.kv_head_num = heads_here if kv_pages != "whole" else 0
    a.kv_layout = pdlib.KVLayout(getattr(args, "kv_layout", pdlib.KVLayout.NHD))
    a.is_mla = is_mla
    a.parallel = pdlib.ParallelConfig(tp_size=attn_tp, tp_rank=tp_rank, dp_size=dp_size,
                                      dp_rank=dp_rank, pp_size=pp_size, pp_rank=pp_rank)
    a.prefill_start_layer = start_layer
    a.device_id = int(_get(args, "gpu_id", 0))
    a.memory_kind = memory_kind
    ib = _get(args, "ib_device", None) or _get(s, "disaggregation_ib_device", None)
    if ib:
        a.nic_names = [d.strip() for d in str(ib).split(",") if d.strip()]
    a.fingerprint = pdlib.ModelFingerprint(
        num_layers=layers, num_kv_heads=fp_heads, head_dim=head_dim, dtype_bytes=elem,
        layout_version=1,
        model_name=env_str("PDLIB_SGLANG_MODEL_NAME") or str(_get(args, "model_name", "")),
        kv_dtype=kv_dtype, page_layout="nhd" if a.kv_layout == pdlib.KVLayout.NHD else "hnd",
        engine_tag=engine_tag)

    bootstrap_host, listen_host = _hosts(s)
    o.bootstrap_host = str(_get(s, "disaggregation_bootstrap_host", bootstrap_host))
    o.bootstrap_port = int(_get(s, "disaggregation_bootstrap_port", 8998))
    o.listen_host = str(_get(s, "pdlib_listen_host", listen_host))
    # SGLang's own timeouts and heartbeat (environ.py), with its defaults.
    o.bootstrap_timeout = env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
    o.waiting_timeout = env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
    interval = max(2.0, env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0))
    failures = max(1.0, env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2.0))
    o.liveness_timeout = float(_get(s, "pdlib_liveness_timeout",
                                    env_float("PDLIB_SGLANG_LIVENESS_TIMEOUT",
                                              interval * failures)))
    o.connect_timeout = float(_get(s, "pdlib_connect_timeout",
                                   env_float("PDLIB_SGLANG_CONNECT_TIMEOUT", o.connect_timeout)))
    o.transfer_timeout = float(_get(s, "pdlib_transfer_timeout",
                                    env_float("PDLIB_SGLANG_TRANSFER_TIMEOUT",
                                              o.transfer_timeout)))
    o.checksum, o.checksum_sample_every = checksum_setting(
        env_str("PDLIB_SGLANG_CHECKSUM") or "off",
        env_str("PDLIB_SGLANG_CHECKSUM_SAMPLE_EVERY") or "64", "PDLIB_SGLANG_CHECKSUM")

    layout = Layout(
        mode=mode, attn_tp_size=attn_tp, tp_rank=tp_rank, dp_size=dp_size, dp_rank=dp_rank,
        kv_pages=kv_pages, families=names, kv_page_bytes=sum(kv_items),
        aux_row_bytes=sum(aux_items),
        state_item_bytes=[sum(f.buffers.item_lens) for f in families], notes=notes,
        why_whole=why)
    return o, layout


def _address(value: Any) -> Optional[int]:
    """The address of an array or tensor attribute (pdlib.buffer_address); None for anything
    else (numbers, strings, None, non-contiguous views)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    try:
        return pdlib.buffer_address(value)[0]
    except (TypeError, ValueError):
        return None


def metadata_buffer_names(aux_ptrs: Sequence[int]) -> Dict[int, str]:
    """SGLang's aux buffers by what they are: address -> the MetadataBuffers attribute it is
    (output_ids, ..., bootstrap_room, a KV checksum row, whatever SGLang adds next). SGLang
    builds aux_data_ptrs from MetadataBuffers.get_buf_infos() and keeps the object in its
    scheduler, not in KVArgs, so it is looked up among the live objects (once, at manager
    creation) by its class name and its buffers' addresses. {} when there is none."""
    import gc

    want = set(int(p) for p in aux_ptrs)
    for obj in gc.get_objects():
        if type(obj).__name__ != "MetadataBuffers":
            continue
        try:
            attrs = vars(obj)
        except TypeError:
            continue
        names = {}
        for name, value in attrs.items():
            addr = _address(value)
            if addr is not None and addr in want:
                names[addr] = name
        if names and set(names) == want:
            return names
    return {}


# get_buf_infos()'s buffer counts when bootstrap_room was last and nothing else was added
# (utils.py at main 3c69a4c7: 10; 11 with DSA top-k indices; 13 or 14 with the sampling-mask
# buffers).
_KNOWN_AUX_COUNTS = (10, 11, 13, 14)


def aux_room_buffer(aux_ptrs: Sequence[int]) -> int:
    """Which aux buffer holds bootstrap_room (pdlib checks it after every transfer): found by
    name through the MetadataBuffers object, so any variant works (a KV checksum row before or
    after it); without the object, the last buffer of a layout known to end with it; else no
    check (-1), logged, rather than a check of the wrong row."""
    names = metadata_buffer_names(aux_ptrs)
    if names:
        for i, p in enumerate(aux_ptrs):
            if names.get(int(p)) == "bootstrap_room":
                return i
        logger.warning("pdlib.sglang: MetadataBuffers has no bootstrap_room among its "
                       "transferred buffers (%s): the room check is off",
                       [names.get(int(p), "?") for p in aux_ptrs])
        return -1
    if len(aux_ptrs) in _KNOWN_AUX_COUNTS:
        return len(aux_ptrs) - 1
    logger.warning("pdlib.sglang: %d aux buffers and no MetadataBuffers object to name them: "
                   "the bootstrap_room check is off (set PDLIB_SGLANG_AUX_ROOM_BUFFER to its "
                   "index to turn it on)", len(aux_ptrs))
    return -1


def state_lists(values: Any, families: Sequence[str]) -> Optional[List[Optional[List[int]]]]:
    """SGLang's per-component state indices (a list parallel to KVArgs.state_types; an entry is
    None, an index array, or, for mamba, a list holding one array) -> one int list per family,
    None for a family that takes no part. None when there are no families or no indices."""
    if values is None or not families:
        return None
    if not isinstance(values, (list, tuple)):
        values = [values]
    if len(values) > len(families):
        raise ValueError(f"state_indices: {len(values)} entries for {len(families)} state "
                         f"components ({', '.join(families)})")
    out: List[Optional[List[int]]] = []
    for f in range(len(families)):
        entry = values[f] if f < len(values) else None
        if entry is None:
            out.append(None)
            continue
        flat: List[int] = []
        for part in (entry if isinstance(entry, (list, tuple)) else [entry]):
            if part is None:
                continue
            if hasattr(part, "cpu") and hasattr(part, "numpy"):  # a torch tensor
                part = part.cpu().numpy()
            if hasattr(part, "reshape"):
                flat.extend(int(v) for v in part.reshape(-1).tolist())
            elif isinstance(part, (list, tuple)):
                flat.extend(int(v) for v in part)
            else:
                flat.append(int(part))
        out.append(flat)
    return out
