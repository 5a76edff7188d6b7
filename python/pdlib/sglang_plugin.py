"""SGLang plugin: `--disaggregation-transfer-backend pdlib` without patching SGLang.

SGLang loads general plugins from the entry-point group `sglang.srt.plugins`
(sglang/srt/plugins/__init__.py load_plugins(), called by `sglang serve`,
`python -m sglang.launch_server` before the arguments are parsed, and by every scheduler
process) and applies the hooks they register with its HookRegistry
(sglang/srt/plugins/hook_registry.py). pdlib's package installs the entry point

    [sglang.srt.plugins]
    pdlib = pdlib.sglang_plugin:register

and register() adds three hooks:
  * REPLACE sglang.srt.disaggregation.utils.TransferBackend with an Enum holding every member
    SGLang has plus PDLIB = "pdlib" (an Enum with members cannot be subclassed); HookRegistry
    rebinds every `from ... import TransferBackend` copy;
  * AROUND sglang.srt.disaggregation.utils.get_kv_class: for "pdlib" it returns SGLang's own
    KVArgs and pdlib.sglang's manager, sender, receiver and bootstrap server; every other
    backend goes to SGLang's function;
  * "pdlib" joins the choices of --disaggregation-transfer-backend
    (add_disagg_transfer_backend_choices).

SGLANG_PLUGINS=pdlib (a comma list) restricts SGLang to named plugins; leave it unset or
include "pdlib". Importing this module needs no SGLang; register() imports it.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any, Callable, Dict

BACKEND = "pdlib"

_TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def kv_classes() -> Dict[str, Any]:
    """KVClassType value -> class, for the "pdlib" backend (KVARGS: SGLang's own KVArgs when
    SGLang is importable, else pdlib.sglang.KVArgs of the same shape)."""
    from pdlib import sglang as adapter

    kv_args: Any = adapter.KVArgs
    try:
        kv_args = importlib.import_module("sglang.srt.disaggregation.base.conn").KVArgs
    except (ImportError, AttributeError):
        pass
    return {
        "kvargs": kv_args,
        "manager": adapter.KVManager,
        "sender": adapter.KVSender,
        "receiver": adapter.KVReceiver,
        "bootstrap_server": adapter.KVBootstrapServer,
    }


def _key(class_type: Any) -> str:
    value = getattr(class_type, "value", None)
    if isinstance(value, str):
        return value.lower()
    return str(getattr(class_type, "name", class_type)).lower()


def get_kv_class(original_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook of get_kv_class(transfer_backend, class_type)."""
    backend = args[0] if args else kwargs.get("transfer_backend")
    if str(getattr(backend, "value", backend)) != BACKEND:
        return original_fn(*args, **kwargs)
    class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
    return kv_classes().get(_key(class_type))


def transfer_backend_enum(original: Any) -> Any:
    """SGLang's TransferBackend with PDLIB = "pdlib" added (the same enum if it has it)."""
    if BACKEND in {m.value for m in original}:
        return original
    members = {m.name: m.value for m in original}
    members["PDLIB"] = BACKEND
    extended = enum.Enum(original.__name__, members)  # type: ignore[misc]
    extended.__module__ = original.__module__
    extended.__qualname__ = original.__qualname__
    return extended


def _add_cli_choice() -> None:
    for module in ("sglang.srt.server_args", "sglang.srt.arg_groups.choices"):
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        choices = getattr(m, "DISAGG_TRANSFER_BACKEND_CHOICES", None)
        add = getattr(m, "add_disagg_transfer_backend_choices", None)
        if choices is not None and BACKEND in choices:
            return
        if add is not None:
            add([BACKEND])
            return
        if isinstance(choices, list):
            choices.append(BACKEND)
            return


def register() -> None:
    """The `sglang.srt.plugins` entry point: called by SGLang's load_plugins()."""
    hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    registry, hook_type = hooks.HookRegistry, hooks.HookType
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    original = utils.TransferBackend
    extended = transfer_backend_enum(original)
    if extended is not original:
        registry.register(_TRANSFER_BACKEND, extended, hook_type.REPLACE)
    registry.register(_GET_KV_CLASS, get_kv_class, hook_type.AROUND)
    _add_cli_choice()
