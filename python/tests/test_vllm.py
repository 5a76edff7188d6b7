"""pdlib.vllm (vLLM's v1 KV connector over pdlib's decode pull) driven the way vLLM drives it.

Each engine is a process (vllm_engine.py: upstream's scheduler and worker call sequence around
the connector, built by a stand-in of vLLM's KVConnectorFactory, tests/vllm_standin); the test
is the router (NIXL's toy proxy): it sends prefill a request with do_remote_decode and
max_tokens=1, copies the kv_transfer_params of its answer into the decode request, and reads
what each engine reports. Decode checks every byte it loaded the moment vLLM learns the load is
done (prefill's model values after the local prefix hit, decode's own before it), prefill
reports when vLLM frees the blocks it held. UCX over shared memory between the processes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from conftest import HERE, UCX_SHM, free_port, needs_ucx

STANDIN = os.path.join(HERE, "vllm_standin")
ENGINE = os.path.join(HERE, "vllm_engine.py")
PREFILL_SALT, DECODE_SALT = 1, 2
BLOCK, HEADS, DIM, LAYERS = 4, 4, 8, 2

pytestmark = needs_ucx


class EngineProc:
    """One engine process; events arrive on a reader thread."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, ENGINE, json.dumps(cfg)], cwd=HERE, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.queue: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.backlog: List[Dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.wait(lambda e: e["event"] in ("ready", "error"), 30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.queue.put(json.loads(line))

    def send(self, *cmds: Dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(json.dumps(c).encode() + b"\n" for c in cmds))
        self.proc.stdin.flush()

    def wait(self, pred: Callable[[Dict[str, Any]], bool], timeout: float = 20.0
             ) -> Dict[str, Any]:
        for i, e in enumerate(self.backlog):
            if pred(e):
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting; events so far: {self.backlog}")
            try:
                e = self.queue.get(timeout=left)
            except queue.Empty:
                continue
            if e["event"] == "error" and not pred(e):
                raise AssertionError(f"engine failed: {e['error']}")
            if pred(e):
                return e
            self.backlog.append(e)

    def event(self, kind: str, req_id: str, timeout: float = 20.0) -> Dict[str, Any]:
        return self.wait(lambda e: e["event"] == kind and e.get("id") == req_id, timeout)

    def stats(self) -> Dict[str, Any]:
        self.send({"op": "stats"})
        return self.wait(lambda e: e["event"] == "stats")

    def no_event(self, kind: str, req_id: str, within: float) -> None:
        with pytest.raises(AssertionError, match="timed out"):
            self.event(kind, req_id, within)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def engine_cfg(layout: str, tp: int, salt: int, port: int, lease: float = 30.0,
               **over: Any) -> Dict[str, Any]:
    extra = {"backend": "ucx", "backend_options": UCX_SHM, "bootstrap_host": "127.0.0.1",
             "bootstrap_port": port, "pull_lease": lease, "liveness_timeout": 1.0,
             "connect_timeout": 2.0}
    extra.update(over.pop("extra", {}))
    cfg = {"layout": layout, "tp": tp, "salt": salt, "remote_salt": PREFILL_SALT,
           "block_size": BLOCK, "heads": HEADS, "head_dim": DIM, "layers": LAYERS,
           "num_blocks": 96, "extra": extra}
    cfg.update(over)
    return cfg


class Pair:
    def __init__(self, layout: str, prefill_tp: int, decode_tp: int, lease: float = 30.0,
                 decode_over: Optional[Dict[str, Any]] = None,
                 prefill_over: Optional[Dict[str, Any]] = None) -> None:
        self.prefill = EngineProc(engine_cfg(layout, prefill_tp, PREFILL_SALT, free_port(),
                                             lease, **(prefill_over or {})))
        self.decode = EngineProc(engine_cfg(layout, decode_tp, DECODE_SALT, free_port(), lease,
                                            **(decode_over or {})))
        for e in (self.prefill, self.decode):
            assert e.ready["event"] == "ready", e.ready

    def prefill_request(self, req_id: str, prompt: List[int]) -> Dict[str, Any]:
        """The router's first leg: max_tokens=1, do_remote_decode; prefill's answer carries the
        kv_transfer_params for decode."""
        self.prefill.send({"op": "add", "id": req_id, "prompt": prompt, "max_tokens": 1,
                           "kv_transfer_params": {
                               "do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}})
        done = self.prefill.event("finished", req_id)
        assert done["status"] == "FINISHED_LENGTH_CAPPED"
        params = done["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert len(params["remote_block_ids"]) == -(-len(prompt) // BLOCK)
        return params

    def decode_request(self, req_id: str, prompt: List[int], params: Optional[Dict[str, Any]],
                       max_tokens: int = 2) -> None:
        self.decode.send({"op": "add", "id": req_id, "prompt": prompt,
                          "max_tokens": max_tokens, "kv_transfer_params": params})

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def prompt_of(n: int, seed: int) -> List[int]:
    return [(seed * 131 + i * 17) % 5000 + 1 for i in range(n)]


def loaded_bytes(prompt_len: int, tp_heads: int = HEADS, kv: int = 2) -> int:
    """Bytes decode checks for a whole prompt (over all its ranks): tokens x layers x K/V x
    heads x dim x fp16."""
    return prompt_len * LAYERS * kv * tp_heads * DIM * 2


@pytest.fixture(scope="module")
def shared() -> Iterator[Pair]:
    """FlashAttention TP 1 -> 1, 30 s lease: the tests that need nothing else share it (each
    uses its own request ids and prompts, and counts bytes as differences)."""
    pair = Pair("flash_attn", 1, 1)
    yield pair
    pair.close()


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    made: List[Pair] = []

    def make(*args: Any, **kw: Any) -> Pair:
        made.append(Pair(*args, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def transfer(pair: Pair, req_id: str, prompt: List[int]) -> Dict[str, Any]:
    params = pair.prefill_request(req_id, prompt)
    pair.decode_request(req_id, prompt, params)
    got = pair.decode.event("received", req_id)
    done = pair.decode.event("finished", req_id)
    assert done["status"] == "FINISHED_LENGTH_CAPPED" and done["output_len"] == 2
    pair.prefill.event("freed", req_id)  # vLLM freed prefill's held blocks (finished_sending)
    return got


CASES = [  # layout, prefill TP, decode TP, heads checked on decode, K/V buffers
    ("flash_attn", 1, 1, HEADS, 2),
    ("flash_attn", 2, 1, HEADS, 2),
    ("flash_attn", 1, 2, HEADS, 2),
    ("flashinfer", 1, 1, HEADS, 2),
    ("mla", 1, 1, 1, 1),
    ("mla", 2, 1, 1, 1),
]


@pytest.mark.parametrize("layout, ptp, dtp, heads, kv", CASES,
                         ids=[f"{c[0]}-tp{c[1]}to{c[2]}" for c in CASES])
def test_every_byte_reaches_decode(pairs, shared, layout, ptp, dtp, heads, kv):
    pair = shared if (layout, ptp, dtp) == ("flash_attn", 1, 1) else pairs(layout, ptp, dtp)
    moved, before = 0, pair.decode.stats()["decode_bytes"]
    for i, n in enumerate([1, 4, 9, 23]):
        prompt = prompt_of(n, 100 + 10 * CASES.index((layout, ptp, dtp, heads, kv)) + i)
        got = transfer(pair, f"req-{layout}-{i}", prompt)
        assert got["hit_tokens"] == 0 and got["invalid"] == []
        assert got["bytes_wrong"] == 0
        # MLA: every decode rank holds the whole latent (replicated), so it is checked per rank.
        assert got["bytes_checked"] == loaded_bytes(n, heads, kv) * (dtp if layout == "mla"
                                                                      else 1)
        moved += len(got["blocks"]) * BLOCK * LAYERS * kv * heads * DIM * 2 * \
            (dtp if layout == "mla" else 1)
    # Decode's pdlib counted exactly the blocks it read, all ranks together.
    assert pair.decode.stats()["decode_bytes"] - before == moved


def test_decode_prefix_hit_reads_only_the_tail(shared):
    pair = shared
    shared = prompt_of(12, 7)  # three whole blocks
    # Decode computes a first request itself; its three blocks enter its prefix cache.
    pair.decode_request("warm", shared, None, max_tokens=1)
    assert pair.decode.event("finished", "warm")["status"] == "FINISHED_LENGTH_CAPPED"
    before = pair.decode.stats()["decode_bytes"]
    # A longer prompt with the same start: decode holds 12 tokens, reads the other 3 blocks.
    prompt = shared + prompt_of(10, 8)
    got = transfer(pair, "tail", prompt)
    assert got["hit_tokens"] == 12
    assert got["bytes_wrong"] == 0 and got["bytes_checked"] == loaded_bytes(22 - 12)
    # The prefix blocks still hold decode's own values: nothing was written into them.
    assert got["prefix_bytes_checked"] == loaded_bytes(12) and got["prefix_bytes_wrong"] == 0
    block_bytes = BLOCK * LAYERS * 2 * HEADS * DIM * 2
    assert pair.decode.stats()["decode_bytes"] - before == 3 * block_bytes
    # All but the last token held: only the last block is read.
    got = transfer(pair, "last", shared + [77])
    assert got["hit_tokens"] == 12 and got["bytes_wrong"] == 0
    assert got["bytes_checked"] == loaded_bytes(1)
    assert pair.decode.stats()["decode_bytes"] - before == 4 * block_bytes


def test_abort_before_decode_scheduled_frees_prefill_at_once(shared):
    pair = shared  # a 30 s lease: only decode's release frees the blocks in time
    before = pair.decode.stats()["decode_bytes"]
    prompt = prompt_of(9, 33)
    params = pair.prefill_request("gone", prompt)
    pair.decode.send({"op": "add", "id": "gone", "prompt": prompt, "max_tokens": 2,
                      "kv_transfer_params": params}, {"op": "abort", "id": "gone"})
    done = pair.decode.event("finished", "gone")
    assert done["status"] == "FINISHED_ABORTED" and done["kv_transfer_params"] is None
    started = time.monotonic()
    pair.prefill.event("freed", "gone", timeout=10)
    assert time.monotonic() - started < 10
    pair.decode.no_event("received", "gone", 0.5)  # not reported to vLLM: it never loaded
    assert pair.decode.stats()["decode_bytes"] == before


def test_abort_while_loading_keeps_decode_blocks_until_pdlib_frees_them(pairs):
    pair = pairs("flash_attn", 1, 1, lease=1.0)
    prompt = prompt_of(9, 6)
    params = pair.prefill_request("stuck", prompt)
    pair.prefill.proc.send_signal(signal.SIGSTOP)  # prefill (and its bootstrap server) frozen
    try:
        pair.decode_request("stuck", prompt, params)
        time.sleep(0.5)  # decode scheduled it: WAITING_FOR_REMOTE_KVS, its receiver looking up
        pair.decode.send({"op": "abort", "id": "stuck"})
        assert pair.decode.event("finished", "stuck")["status"] == "FINISHED_ABORTED"
        # vLLM holds the blocks of a request aborted while loading until the workers report it
        # received; they do once pdlib says nothing can land in them any more.
        freed = pair.decode.event("freed", "stuck", timeout=20)
        assert freed["side"] == "decode"
        pair.decode.no_event("received", "stuck", 0.3)
    finally:
        pair.prefill.proc.send_signal(signal.SIGCONT)
    pair.prefill.event("freed", "stuck", timeout=20)  # prefill's lease: no decode bound


def test_killed_prefill_reports_load_errors_and_decode_recomputes(pairs):
    pair = pairs("flash_attn", 1, 1)
    prompt = prompt_of(10, 5)
    params = pair.prefill_request("orphan", prompt)
    pair.prefill.kill()
    pair.decode_request("orphan", prompt, params)
    got = pair.decode.event("received", "orphan", timeout=30)
    # Every block of the load is reported (get_block_ids_with_load_errors) with the request.
    assert got["invalid"] == got["blocks"] and len(got["blocks"]) == 3
    # vLLM's recompute policy then computes the prompt on decode and finishes the request.
    done = pair.decode.event("finished", "orphan", timeout=30)
    assert done["status"] == "FINISHED_LENGTH_CAPPED" and done["output_len"] == 2


def test_lease_expiry_frees_prefill_and_a_late_decode_recomputes(pairs):
    pair = pairs("flash_attn", 1, 1, lease=1.0)
    prompt = prompt_of(7, 9)
    params = pair.prefill_request("late", prompt)
    started = time.monotonic()
    pair.prefill.event("freed", "late", timeout=10)  # no decode came: the lease freed them
    assert time.monotonic() - started < 8
    pair.decode_request("late", prompt, params)
    got = pair.decode.event("received", "late", timeout=20)
    assert got["invalid"] == got["blocks"]
    assert pair.decode.event("finished", "late")["output_len"] == 2


def test_flashinfer_unequal_tp_fails_the_load_with_pdlibs_reason(pairs):
    # FlashInfer blocks hold K then V of every head: they move whole, between equal TP only.
    pair = pairs("flashinfer", 2, 1)
    prompt = prompt_of(6, 2)
    params = pair.prefill_request("fi", prompt)
    pair.decode_request("fi", prompt, params)
    got = pair.decode.event("received", "fi", timeout=20)
    assert got["invalid"] == got["blocks"]
    assert pair.decode.event("finished", "fi")["output_len"] == 2


def test_producer_and_consumer_roles(pairs):
    pair = pairs("flash_attn", 1, 1, prefill_over={"kv_role": "kv_producer"},
                 decode_over={"kv_role": "kv_consumer"})
    prompt = prompt_of(11, 12)
    got = transfer(pair, "roles", prompt)
    assert got["bytes_wrong"] == 0 and got["bytes_checked"] == loaded_bytes(11)
    # A consumer hands nothing over; a producer loads nothing: both compute, nothing is held.
    pair.decode.send({"op": "add", "id": "d-as-p", "prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}})
    assert pair.decode.event("finished", "d-as-p")["kv_transfer_params"] is None
    params = pair.prefill_request("p", prompt)
    pair.prefill.send({"op": "add", "id": "p-as-d", "prompt": prompt, "max_tokens": 2,
                       "kv_transfer_params": params})
    assert pair.prefill.event("finished", "p-as-d")["output_len"] == 2
    pair.prefill.no_event("received", "p-as-d", 0.3)


def test_incompatible_model_fails_the_load_and_decode_recomputes(pairs):
    # pdlib's registration compares the fingerprint (head size here): prefill refuses decode.
    pair = pairs("flash_attn", 1, 1, decode_over={"head_dim": 2 * DIM})
    prompt = prompt_of(6, 55)
    params = pair.prefill_request("fp", prompt)
    pair.decode_request("fp", prompt, params)
    got = pair.decode.event("received", "fp", timeout=20)
    assert got["invalid"] == got["blocks"] and got["bytes_wrong"] == 0
    assert pair.decode.event("finished", "fp")["output_len"] == 2
    assert pair.decode.stats()["decode_bytes"] == 0


def test_block_size_mismatch_is_computed_locally(shared):
    pair = shared
    prompt = prompt_of(8, 44)
    params = pair.prefill_request("bs", prompt)
    params["pdlib_block_size"] = 16  # a prefill with another --block-size
    pair.decode_request("bs", prompt, params)
    done = pair.decode.event("finished", "bs")
    assert done["output_len"] == 2
    pair.decode.no_event("received", "bs", 0.3)
    pair.prefill.event("freed", "bs", timeout=10)  # released at once (the lease is 30 s)


def test_unknown_extra_config_key_is_refused_naming_it():
    e = EngineProc(engine_cfg("flash_attn", 1, 1, free_port(), extra={"bakend": "ucx"}))
    try:
        assert e.ready["event"] == "error"
        assert "unknown kv_connector_extra_config key(s) ['bakend']" in e.ready["error"]
    finally:
        e.close()


# -- in this process: the stand-in on sys.path ------------------------------------------------


@pytest.fixture
def connector_module(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    import importlib

    return importlib.import_module("pdlib.vllm")


def test_without_vllm_import_is_refused_with_the_reason():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if "vllm_standin" not in p)
    r = subprocess.run([sys.executable, "-c", "import pdlib.vllm"], capture_output=True,
                       text=True, env=env, cwd="/")
    assert r.returncode != 0
    assert "ImportError: pdlib.vllm is a vLLM KV connector and needs vLLM" in r.stderr


def test_required_layout(connector_module):
    from vllm.config import ModelConfig, VllmConfig

    cls = connector_module.PdlibConnector
    assert cls.get_required_kvcache_layout(VllmConfig(model_config=ModelConfig())) == "HND"
    assert cls.get_required_kvcache_layout(
        VllmConfig(model_config=ModelConfig(use_mla=True))) is None
    assert cls.get_required_kvcache_layout(VllmConfig()) is None


def test_describe_kv_caches_layouts(connector_module):
    import torch

    describe = connector_module.describe_kv_caches
    nb, bs, h, d = 6, 4, 2, 8
    hnd = torch.zeros(2, nb, h, bs, d, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    other = torch.zeros(2, nb, h, bs, d, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    # Two layers on one tensor are one layer's buffers; K of every layer, then V.
    r = describe({"a": hnd, "b": hnd, "c": other}, nb, bs, False)
    page = bs * h * d * 2
    assert (r.layout, r.num_layers, r.kv_heads, r.head_dim, r.hnd, r.kv_dtype) == \
        ("flash_attn", 2, h, d, True, "bf16")
    assert r.buffers == [(hnd.data_ptr(), nb * page, page), (other.data_ptr(), nb * page, page),
                         (hnd.data_ptr() + nb * page, nb * page, page),
                         (other.data_ptr() + nb * page, nb * page, page)]
    nhd = torch.zeros(2, nb, bs, h, d, dtype=torch.float16)
    assert describe({"a": nhd}, nb, bs, False).hnd is False
    fi = torch.zeros(nb, 2, h, bs, d, dtype=torch.float16).permute(0, 1, 3, 2, 4)
    r = describe({"a": fi}, nb, bs, False)
    assert r.layout == "flashinfer" and r.buffers == [(fi.data_ptr(), nb * 2 * page, 2 * page)]
    mla = torch.zeros(nb, bs, 576, dtype=torch.float16)
    r = describe({"a": mla}, nb, bs, True)
    assert r.layout == "mla" and r.buffers == [(mla.data_ptr(), nb * bs * 576 * 2, bs * 576 * 2)]
    with pytest.raises(ValueError, match="neither FlashAttention"):
        describe({"a": torch.zeros(2, nb + 1, bs, h, d)}, nb, bs, False)
    with pytest.raises(ValueError, match="kernel block size"):
        describe({"a": torch.zeros(2, nb, bs * 2, h, d)}, nb, bs, False)
    with pytest.raises(ValueError, match="cannot be told apart"):
        describe({"a": torch.zeros(2, 2, bs, h, d)}, 2, bs, False)
    with pytest.raises(ValueError, match="MLA"):
        describe({"a": torch.zeros(nb, bs, 4, 4)}, nb, bs, True)
    with pytest.raises(ValueError, match="mixed attention backends"):
        describe({"a": hnd, "b": nhd.to(torch.bfloat16)}, nb, bs, False)


def test_remote_params_are_validated(connector_module):
    parse = connector_module._parse_remote
    good = {"pdlib_room": 5, "remote_host": "10.0.0.1", "remote_port": 8998,
            "remote_block_ids": [3, 4], "pdlib_block_size": 16}
    r = parse(dict(good), 16)
    assert (r.room, r.bootstrap, r.num_blocks) == (5, "10.0.0.1:8998", 2)
    for key, bad, says in [
        ("pdlib_room", -1, "not a room id"), ("pdlib_room", True, "not a room id"),
        ("remote_port", 70000, "not an address"), ("remote_host", "", "not an address"),
        ("remote_block_ids", [], "non-empty list"), ("remote_block_ids", [1, -2], "non-empty"),
        ("remote_block_ids", "12", "non-empty"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse(dict(good, **{key: bad}), 16)
    # Another block size: not readable, but the room can still be released.
    assert "prefill's block size 32 differs from decode's 16" in \
        parse(dict(good, pdlib_block_size=32), 16).block_size_error
    with pytest.raises(ValueError, match="lack 'pdlib_room'"):
        parse({k: v for k, v in good.items() if k != "pdlib_room"}, 16)
