"""The SGLang plugin (pdlib.sglang_plugin): its entry point resolves from the package's
metadata, registers "pdlib", and get_kv_class returns the adapter's classes.

SGLang itself is not installed here: a stand-in of the modules the plugin touches is written
from upstream's signatures (sgl-project/sglang main at 3c69a4c7, 2026-08-22, python/sglang/srt/):
  plugins/__init__.py (7ca35661)     load_plugins(): entry points of group sglang.srt.plugins,
                                     SGLANG_PLUGINS filter, then HookRegistry.apply_hooks()
  plugins/hook_registry.py (7ca35661, 2026-04-19) HookRegistry.register(target, hook, hook_type),
                                     apply_hooks() (class REPLACE targets first), AROUND
                                     wrappers, _propagate_patch over sys.modules
  disaggregation/utils.py (ac179eec)  TransferBackend, KVClassType, get_kv_class
  server_args.py                     DISAGG_TRANSFER_BACKEND_CHOICES,
                                     add_disagg_transfer_backend_choices
"""

from __future__ import annotations

import argparse
import enum
import functools
import importlib
import importlib.metadata
import os
import pkgutil
import subprocess
import sys
import types
from collections import defaultdict

import pytest

import pdlib
from pdlib import sglang as pd
from pdlib import sglang_plugin


def _module(name: str, package: bool = False) -> types.ModuleType:
    m = types.ModuleType(name)
    if package:
        m.__path__ = []  # type: ignore[attr-defined]
    sys.modules[name] = m
    return m


def _install_standin() -> types.SimpleNamespace:
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation",
                 "sglang.srt.disaggregation.base", "sglang.srt.plugins"):
        _module(name, package=True)

    conn = _module("sglang.srt.disaggregation.base.conn")

    class KVArgs:  # base/conn.py: annotations only
        engine_rank: int
        kv_data_ptrs: list
        num_draft_entries: int = 0

    conn.KVArgs = KVArgs

    utils = _module("sglang.srt.disaggregation.utils")

    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        MORI = "mori"
        NIXL = "nixl"
        ASCEND = "ascend"
        FAKE = "fake"

    class KVClassType(enum.Enum):
        KVARGS = "kvargs"
        MANAGER = "manager"
        SENDER = "sender"
        RECEIVER = "receiver"
        BOOTSTRAP_SERVER = "bootstrap_server"

    class FakeKVManager:
        pass

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend == utils.TransferBackend.FAKE:
            return {KVClassType.KVARGS: KVArgs, KVClassType.MANAGER: FakeKVManager}.get(
                class_type)
        raise ValueError(f"Unsupported transfer backend: {transfer_backend}")

    utils.TransferBackend, utils.KVClassType, utils.get_kv_class = (TransferBackend,
                                                                    KVClassType, get_kv_class)
    utils.FakeKVManager = FakeKVManager

    # A scheduler module that imported them before the plugins were loaded.
    sched = _module("sglang.srt.disaggregation.prefill")
    sched.TransferBackend, sched.get_kv_class = TransferBackend, get_kv_class

    args = _module("sglang.srt.server_args")
    args.DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl", "ascend", "fake", "mori",
                                            "mooncake_tcp"]

    def add_disagg_transfer_backend_choices(choices):
        args.DISAGG_TRANSFER_BACKEND_CHOICES.extend(choices)

    def prepare_server_args(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--disaggregation-transfer-backend", default="mooncake",
                            choices=args.DISAGG_TRANSFER_BACKEND_CHOICES)
        return parser.parse_args(argv)

    args.add_disagg_transfer_backend_choices = add_disagg_transfer_backend_choices
    args.prepare_server_args = prepare_server_args

    hooks = _module("sglang.srt.plugins.hook_registry")

    class HookType(enum.Enum):
        BEFORE = "before"
        AFTER = "after"
        AROUND = "around"
        REPLACE = "replace"

    def _wrap_fn(original_fn, hook, hook_type):
        if hook_type == HookType.AROUND:
            @functools.wraps(original_fn)
            def wrapper(*a, **kw):
                return hook(original_fn, *a, **kw)
        elif hook_type == HookType.REPLACE:
            @functools.wraps(original_fn)
            def wrapper(*a, **kw):
                return hook(*a, **kw)
        else:
            raise NotImplementedError(hook_type)
        wrapper.__wrapped__ = original_fn
        return wrapper

    def _propagate_patch(original, wrapped, source_module):
        for mod in list(sys.modules.values()):
            if mod is source_module or not isinstance(mod, types.ModuleType):
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    setattr(mod, attr, wrapped)

    class HookRegistry:
        _hooks = defaultdict(list)
        _patched: set = set()

        @classmethod
        def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
            if isinstance(hook, type) and hook_type != HookType.REPLACE:
                raise TypeError("a class can only be used with HookType.REPLACE")
            cls._hooks[target].append((hook_type, hook, source))

        @classmethod
        def apply_hooks(cls):
            def key(item):
                _, hs = item
                return (0 if any(isinstance(h, type) and t == HookType.REPLACE
                                 for t, h, _ in hs) else 1, item[0])

            for target, hs in sorted(cls._hooks.items(), key=key):
                if target in cls._patched:
                    continue
                obj_path, attr = target.rsplit(".", 1)
                obj = pkgutil.resolve_name(obj_path)
                original = getattr(obj, attr)
                if isinstance(original, type) and any(t != HookType.REPLACE for t, _, _ in hs):
                    raise TypeError("only REPLACE for a class target")
                wrapped = original
                for t, h, _ in sorted(hs, key=lambda x: 0 if x[0] == HookType.REPLACE else 1):
                    wrapped = h if isinstance(h, type) else _wrap_fn(wrapped, h, t)
                setattr(obj, attr, wrapped)
                if wrapped is not original:
                    _propagate_patch(original, wrapped, obj)
                cls._patched.add(target)

        @classmethod
        def reset(cls):
            cls._hooks.clear()
            cls._patched.clear()

    hooks.HookType, hooks.HookRegistry = HookType, HookRegistry

    plugins = sys.modules["sglang.srt.plugins"]
    plugins.GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
    plugins._plugins_loaded = False

    def load_plugins():
        if plugins._plugins_loaded:
            return
        plugins._plugins_loaded = True
        allowed = os.environ.get("SGLANG_PLUGINS")
        allowed_set = {x.strip() for x in allowed.split(",") if x.strip()} if allowed else None
        for ep in importlib.metadata.entry_points(group=plugins.GENERAL_PLUGINS_GROUP):
            if allowed_set is not None and ep.name not in allowed_set:
                continue
            ep.load()()
        HookRegistry.apply_hooks()

    plugins.load_plugins = load_plugins
    return types.SimpleNamespace(utils=utils, sched=sched, args=args, hooks=hooks,
                                 plugins=plugins, conn=conn)


@pytest.fixture
def sglang(monkeypatch):
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    standin = _install_standin()
    yield standin
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_entry_point_resolves_from_the_package_metadata():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
           if ep.name == "pdlib"]
    assert len(eps) == 1, eps
    assert eps[0].value == "pdlib.sglang_plugin:register"
    assert eps[0].load() is sglang_plugin.register
    assert eps[0].dist is not None and eps[0].dist.name == "pdlib"
    assert eps[0].dist.version == pdlib.__version__


def test_load_plugins_registers_pdlib(sglang):
    sglang.plugins.load_plugins()
    utils = sglang.utils
    backend = utils.TransferBackend("pdlib")  # TransferBackend(server_args...) in SGLang
    assert backend.value == "pdlib" and utils.TransferBackend.PDLIB is backend
    assert {m.value for m in utils.TransferBackend} >= {"mooncake", "mori", "nixl", "ascend",
                                                        "fake", "pdlib"}
    kinds = utils.KVClassType
    assert utils.get_kv_class(backend, kinds.MANAGER) is pd.KVManager
    assert utils.get_kv_class(backend, kinds.SENDER) is pd.KVSender
    assert utils.get_kv_class(backend, kinds.RECEIVER) is pd.KVReceiver
    assert utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is pd.KVBootstrapServer
    assert utils.get_kv_class(backend, kinds.KVARGS) is sglang.conn.KVArgs  # SGLang's own
    # Every other backend still goes to SGLang's function.
    fake = utils.TransferBackend("fake")
    assert utils.get_kv_class(fake, kinds.MANAGER) is utils.FakeKVManager
    with pytest.raises(ValueError, match="Unsupported transfer backend"):
        utils.get_kv_class(utils.TransferBackend("nixl"), kinds.MANAGER)
    # Modules that imported the originals see the hooked ones (HookRegistry's propagation).
    assert sglang.sched.TransferBackend is utils.TransferBackend
    assert sglang.sched.get_kv_class(backend, kinds.SENDER) is pd.KVSender
    # The CLI accepts it.
    ns = sglang.args.prepare_server_args(["--disaggregation-transfer-backend", "pdlib"])
    assert ns.disaggregation_transfer_backend == "pdlib"
    assert sglang.args.DISAGG_TRANSFER_BACKEND_CHOICES.count("pdlib") == 1
    # Registering again (another process start-up) adds nothing twice.
    sglang_plugin.register()
    assert sglang.args.DISAGG_TRANSFER_BACKEND_CHOICES.count("pdlib") == 1


def test_sglang_plugins_filter_leaves_it_out(sglang, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    sglang.plugins.load_plugins()
    with pytest.raises(ValueError):
        sglang.utils.TransferBackend("pdlib")
    with pytest.raises(SystemExit):
        sglang.args.prepare_server_args(["--disaggregation-transfer-backend", "pdlib"])


def test_cmake_install_puts_the_entry_point_next_to_the_package(tmp_path):
    build_python = os.path.dirname(os.path.dirname(os.path.abspath(pdlib.__file__)))
    if not os.path.exists(os.path.join(build_python, "cmake_install.cmake")):
        pytest.skip("pdlib is not imported from a build tree")
    subprocess.run(["cmake", "--install", build_python, "--prefix", str(tmp_path)], check=True,
                   stdout=subprocess.DEVNULL)
    found = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files
             if f == "entry_points.txt"]
    assert len(found) == 1, found
    dist = os.path.dirname(found[0])
    assert os.path.basename(dist) == f"pdlib-{pdlib.__version__}.dist-info"
    assert os.path.isdir(os.path.join(os.path.dirname(dist), "pdlib"))
    with open(found[0]) as f:
        assert "[sglang.srt.plugins]\npdlib = pdlib.sglang_plugin:register" in f.read()
    # The installed tree alone resolves it.
    code = ("import importlib.metadata as m; "
            "print([e.value for e in m.entry_points(group='sglang.srt.plugins')])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(dist)))
    assert "pdlib.sglang_plugin:register" in out.stdout
