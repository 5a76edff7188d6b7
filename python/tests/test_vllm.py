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
BLOCK, HEADS, DIM, LAYERS = 16, 4, 8, 2  # FlashAttention wants block sizes of 16k

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
           "num_blocks": 48, "extra": extra}
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
        blocks = self.prefill.cfg.get("block_size", BLOCK)
        computed = len(prompt) - (1 if "mamba" in self.prefill.cfg.get("groups", []) else 0)
        assert len(params["remote_block_ids"]) == -(-computed // blocks)
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


def loaded_bytes(prompt_len: int, tp_heads: int = HEADS, kv: int = 2, es: int = 2) -> int:
    """Bytes decode checks for a whole prompt (over all its ranks): tokens x layers x K/V x
    heads x dim x element size."""
    return prompt_len * LAYERS * kv * tp_heads * DIM * es


@pytest.fixture(scope="module")
def shared() -> Iterator[Pair]:
    """The packed layout (FlashAttention at 6adad087, HND as pdlib asks), TP 1 -> 1, 30 s lease:
    the tests that need nothing else share it (each uses its own request ids and prompts, and
    counts bytes as differences)."""
    pair = Pair("packed", 1, 1)
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


# Every layout vLLM allocated since 2026-01 (vllm_engine.py kv_shape_and_order): the packed
# K/V of FlashAttention/FlashInfer/Triton since 2026-07-11 in HND (what pdlib asks for) and NHD
# (VLLM_KV_CACHE_LAYOUT=NHD or another connector's wish), FlashAttention's (2, num_blocks, ...)
# until 2026-05-26, its (num_blocks, 2, ...) until 2026-07-11 (and FlashInfer's before), MLA,
# an FP8 cache, and kernel blocks of 16 under --block-size 32.
CASES = [  # id, layout, prefill TP, decode TP, heads checked on decode, K/V, over
    ("packed-hnd-tp1to1", "packed", 1, 1, HEADS, 2, {}),
    ("packed-hnd-tp2to1", "packed", 2, 1, HEADS, 2, {}),
    ("packed-hnd-tp1to2", "packed", 1, 2, HEADS, 2, {}),
    ("packed-nhd-tp1to1", "packed", 1, 1, HEADS, 2, {"nhd": True}),
    ("packed-nhd-tp2to1", "packed", 2, 1, HEADS, 2, {"nhd": True}),
    ("kv_first-hnd-tp2to1", "kv_first", 2, 1, HEADS, 2, {}),
    ("kv_first-nhd-tp1to1", "kv_first", 1, 1, HEADS, 2, {"nhd": True}),
    ("blocks_first-tp1to1", "blocks_first", 1, 1, HEADS, 2, {}),
    ("mla-tp1to1", "mla", 1, 1, 1, 1, {}),
    ("mla-tp2to1", "mla", 2, 1, 1, 1, {}),
    ("packed-fp8-tp1to1", "packed", 1, 1, HEADS, 2, {"fp8": True}),
    ("packed-kernel16-tp2to1", "packed", 2, 1, HEADS, 2,
     {"block_size": 2 * BLOCK, "kernel_block_size": BLOCK}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_byte_reaches_decode(pairs, shared, case):
    name, layout, ptp, dtp, heads, kv, over = case
    pair = shared if name == "packed-hnd-tp1to1" else \
        pairs(layout, ptp, dtp, decode_over=dict(over), prefill_over=dict(over))
    bs = over.get("block_size", BLOCK)
    es = 1 if over.get("fp8") else 2
    moved, before = 0, pair.decode.stats()["decode_bytes"]
    for i, n in enumerate([1, 16, 37, 90]):
        prompt = prompt_of(n, 100 + 10 * CASES.index(case) + i)
        got = transfer(pair, f"req-{name}-{i}", prompt)
        assert got["hit_tokens"] == 0 and got["invalid"] == []
        assert got["bytes_wrong"] == 0
        # MLA: every decode rank holds the whole latent (replicated), so it is checked per rank.
        assert got["bytes_checked"] == loaded_bytes(n, heads, kv, es) * (
            dtp if layout == "mla" else 1)
        moved += len(got["blocks"]) * bs * LAYERS * kv * heads * DIM * es * \
            (dtp if layout == "mla" else 1)
    # Decode's pdlib counted exactly the blocks it read, all ranks together.
    assert pair.decode.stats()["decode_bytes"] - before == moved
    # Nothing outside the requests' blocks was written, on either side.
    assert pair.decode.stats()["untouched_bad"] == 0
    assert pair.prefill.stats()["untouched_bad"] == 0


def test_decode_prefix_hit_reads_only_the_tail(shared):
    pair = shared
    shared = prompt_of(3 * BLOCK, 7)  # three whole blocks
    # Decode computes a first request itself; its three blocks enter its prefix cache.
    pair.decode_request("warm", shared, None, max_tokens=1)
    assert pair.decode.event("finished", "warm")["status"] == "FINISHED_LENGTH_CAPPED"
    before = pair.decode.stats()["decode_bytes"]
    # A longer prompt with the same start: decode holds 48 tokens, reads the other 3 blocks.
    prompt = shared + prompt_of(40, 8)
    got = transfer(pair, "tail", prompt)
    assert got["hit_tokens"] == 3 * BLOCK
    assert got["bytes_wrong"] == 0 and got["bytes_checked"] == loaded_bytes(40)
    # The prefix blocks still hold decode's own values: nothing was written into them.
    assert got["prefix_bytes_checked"] == loaded_bytes(3 * BLOCK)
    assert got["prefix_bytes_wrong"] == 0
    block_bytes = BLOCK * LAYERS * 2 * HEADS * DIM * 2
    assert pair.decode.stats()["decode_bytes"] - before == 3 * block_bytes
    # All but the last token held: only the last block is read.
    got = transfer(pair, "last", shared + [77])
    assert got["hit_tokens"] == 3 * BLOCK and got["bytes_wrong"] == 0
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
    pair = pairs("packed", 1, 1, lease=1.0)
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
    pair = pairs("packed", 1, 1)
    prompt = prompt_of(40, 5)
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
    pair = pairs("packed", 1, 1, lease=1.0)
    prompt = prompt_of(7, 9)
    params = pair.prefill_request("late", prompt)
    started = time.monotonic()
    pair.prefill.event("freed", "late", timeout=10)  # no decode came: the lease freed them
    assert time.monotonic() - started < 8
    pair.decode_request("late", prompt, params)
    got = pair.decode.event("received", "late", timeout=20)
    assert got["invalid"] == got["blocks"]
    assert pair.decode.event("finished", "late")["output_len"] == 2


def test_blocks_first_unequal_tp_fails_the_load_with_pdlibs_reason(pairs):
    # (num_blocks, 2, ...) blocks hold K then V of every head: they move whole, between equal
    # TP only; pdlib refuses the pairing and every block is a load error.
    pair = pairs("blocks_first", 2, 1)
    prompt = prompt_of(6, 2)
    params = pair.prefill_request("fi", prompt)
    pair.decode_request("fi", prompt, params)
    got = pair.decode.event("received", "fi", timeout=20)
    assert got["invalid"] == got["blocks"]
    assert pair.decode.event("finished", "fi")["output_len"] == 2


def test_producer_and_consumer_roles(pairs):
    pair = pairs("packed", 1, 1, prefill_over={"kv_role": "kv_producer"},
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
    pair = pairs("packed", 1, 1, decode_over={"head_dim": 2 * DIM})
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
    params["pdlib_block_size"] = 2 * BLOCK  # a prefill with another --block-size
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


def test_checksum_extra_config_reaches_the_manager_or_is_refused(connector_module):
    """kv_connector_extra_config checksum (issue #42): off, sampled or all; a bad value is
    refused naming it, a good one is the manager's KVManagerOptions.checksum."""
    _ConfigError, _Settings = connector_module._ConfigError, connector_module._Settings
    s = _Settings.parse({"checksum": "sampled", "checksum_sample_every": 4}, 0)
    kinds = connector_module.pdlib.KvChecksum
    assert (s.checksum, s.checksum_sample_every) == (kinds.Sampled, 4)
    assert _Settings.parse({}, 0).checksum == kinds.Off
    with pytest.raises(_ConfigError, match="checksum"):
        _Settings.parse({"checksum": "yes"}, 0)


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
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    assert supports_hma(cls)  # vLLM keeps its hybrid allocator on
    assert cls.get_required_kvcache_layout(
        VllmConfig(model_config=ModelConfig(use_mla=True))) is None
    assert cls.get_required_kvcache_layout(VllmConfig()) is None


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


# -- hybrid models (SupportsHMA), async scheduling, failures before init ----------------------

HYBRID = {"groups": ["full", "swa", "mamba"], "window": 2 * BLOCK,
          "enable_prefix_caching": False}


def hybrid_bytes(n: int, tp_heads: int = HEADS) -> int:
    """What decode checks of a hybrid load of an n-token prompt: prefill computed n - 1 tokens
    (decode recomputes the last from the state it reads); full attention every token, sliding
    window the window's tokens, Mamba the whole state page (padded to the attention page)."""
    tokens = n - 1
    full = loaded_bytes(tokens, tp_heads)
    window = loaded_bytes(min(tokens, HYBRID["window"]), tp_heads)
    page = 2 * BLOCK * tp_heads * DIM * 2
    return full + window + LAYERS * page


def test_hybrid_three_groups_every_byte(pairs):
    # Full attention + sliding window + Mamba (the seeds' model kind): one block table per
    # group; the window's tail and the running state travel as pdlib state families.
    pair = pairs("packed", 1, 1, decode_over=dict(HYBRID), prefill_over=dict(HYBRID))
    for i, n in enumerate([2, 20, 90]):
        prompt = prompt_of(n, 300 + i)
        got = transfer(pair, f"hy-{i}", prompt)
        assert got["invalid"] == [] and got["bytes_wrong"] == 0
        assert got["bytes_checked"] == hybrid_bytes(n), got
        assert got["end"] == n - 1  # the state is h(n - 1): decode computes token n itself
    assert pair.decode.stats()["untouched_bad"] == 0


def test_hybrid_unequal_tp_reports_every_block_of_every_group(pairs):
    # Mamba state moves by rank (its pages pack conv and SSM state of a rank's heads): TP 2 -> 1
    # is refused at registration, and the load reports every block it would have written in
    # every group. vLLM 6adad087 cannot take load errors of a multi-group request yet: its
    # _update_requests_with_invalid_blocks unpacks one group ("TODO (davidb): add support for
    # hybrid memory allocator") and raises, which the replay reproduces.
    pair = pairs("packed", 2, 1, decode_over=dict(HYBRID), prefill_over=dict(HYBRID))
    prompt = prompt_of(90, 77)
    params = pair.prefill_request("hy-tp", prompt)
    pair.decode_request("hy-tp", prompt, params)
    errors = pair.decode.wait(lambda e: e["event"] == "load_errors", 30)
    full = -(-89 // BLOCK)
    assert len(errors["blocks"]) == full + 3 + 1  # full group, window tail, running state
    crash = pair.decode.wait(lambda e: e["event"] == "error", 10)
    assert "too many values to unpack" in crash["error"]


def test_hybrid_sliding_window_prefix_hit_is_computed_locally(pairs):
    swa = {"groups": ["full", "swa"], "window": 2 * BLOCK}
    pair = pairs("packed", 1, 1, decode_over=dict(swa), prefill_over=dict(swa))
    shared = prompt_of(3 * BLOCK, 41)
    pair.decode_request("warm", shared, None, max_tokens=1)
    assert pair.decode.event("finished", "warm")["status"] == "FINISHED_LENGTH_CAPPED"
    prompt = shared + prompt_of(20, 42)
    params = pair.prefill_request("swa-hit", prompt)
    pair.decode_request("swa-hit", prompt, params)
    assert pair.decode.event("finished", "swa-hit")["output_len"] == 2
    pair.decode.no_event("received", "swa-hit", 0.3)
    pair.prefill.event("freed", "swa-hit", timeout=10)  # released at once (30 s lease)
    # Without a hit the same model loads: window and full attention byte for byte.
    got = transfer(pair, "swa-miss", prompt_of(50, 43))
    assert got["bytes_wrong"] == 0 and got["invalid"] == []
    assert got["bytes_checked"] == loaded_bytes(50) + loaded_bytes(2 * BLOCK)


def test_async_scheduling_one_step_ahead(pairs):
    over = {"async_scheduling": True}
    pair = pairs("packed", 2, 1, decode_over=dict(over), prefill_over=dict(over))
    prompts = {f"as-{i}": prompt_of(n, 500 + i) for i, n in enumerate([5, 33, 64, 17])}
    params = {r: pair.prefill_request(r, p) for r, p in prompts.items()}
    for r, p in prompts.items():  # all in flight at once
        pair.decode_request(r, p, params[r])
    for r, p in prompts.items():
        got = pair.decode.event("received", r)
        assert got["bytes_wrong"] == 0 and got["bytes_checked"] == loaded_bytes(len(p))
        assert pair.decode.event("finished", r)["output_len"] == 2
        pair.prefill.event("freed", r)
    # Finished while its load is in flight (aborted right after it was scheduled).
    prompt = prompt_of(40, 599)
    p = pair.prefill_request("as-abort", prompt)
    pair.decode.send({"op": "add", "id": "as-abort", "prompt": prompt, "max_tokens": 2,
                      "kv_transfer_params": p}, {"op": "abort", "id": "as-abort"})
    assert pair.decode.event("finished", "as-abort")["status"] == "FINISHED_ABORTED"
    pair.prefill.event("freed", "as-abort", timeout=20)
    assert pair.decode.stats()["untouched_bad"] == 0


class _FailedReceiver:
    """pdlib's receiver for a room that failed before init(): init raises, poll reads Failed,
    and pdlib holds no pages for it (invalid_pages() is empty)."""

    def __init__(self) -> None:
        self.aborted = ""

    def init(self, *args: Any, **kw: Any) -> None:
        import pdlib
        raise pdlib.Error("FAILED_PRECONDITION: room 7: prefill refused the pairing",
                          int(pdlib.StatusCode.FailedPrecondition))

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def poll(self) -> Any:
        import pdlib
        return pdlib.KVPoll.Failed

    def pages_reusable(self) -> bool:
        return True

    def invalid_pages(self) -> List[int]:
        return []

    def failure_reason(self) -> str:
        return "FAILED_PRECONDITION: prefill refused the pairing"

    def close(self) -> None:
        pass


def test_failure_before_init_reports_every_block(connector_module):
    # The bug of issue 40: a room that failed before init() was kept as a normal load and
    # reported with invalid_pages() == [], so vLLM kept blocks nobody wrote.
    m = connector_module
    w = m._Worker.__new__(m._Worker)
    w.description = None
    w.block_size = BLOCK
    w._recving, w._releasing, w._sending, w._failed_senders = {}, [], {}, []
    w._send_failed_now, w._invalid = set(), set()
    import threading as _t
    w._lock = _t.Lock()

    class _Decode:
        def create_receiver(self, bootstrap: str, room: int) -> _FailedReceiver:
            return _FailedReceiver()

    w.decode = _Decode()
    w._start_read("r1", m._RecvReq(7, "127.0.0.1:1", [5, 9, 11], 4, state_ids=[[20], [21]]))
    done_sending, done_recving = w.get_finished(set())
    assert done_recving == {"r1"}
    assert w.get_block_ids_with_load_errors() == {5, 9, 11, 20, 21}


def test_request_finished_single_group_and_prompt_clip(connector_module):
    # vLLM without the hybrid allocator calls request_finished(request, block_ids); a prefill
    # that generated past its prompt hands over only the prompt's blocks (decode reads those).
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    cfg = VllmConfig(model_config=ModelConfig(total_num_kv_heads=HEADS, head_size=DIM),
                     cache_config=CacheConfig(block_size=BLOCK),
                     kv_transfer_config=KVTransferConfig(
                         kv_connector="PdlibConnector", kv_connector_module_path="pdlib.vllm",
                         kv_role="kv_producer",
                         kv_connector_extra_config={"backend": "fake",
                                                    "bootstrap_host": "127.0.0.1",
                                                    "bootstrap_port": free_port()}))
    c = connector_module.PdlibConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        req = Request("p1", list(range(1, 2 * BLOCK + 2)), SamplingParams(
            max_tokens=4, extra_args={"kv_transfer_params": {"do_remote_decode": True}}), None)
        req.status = RequestStatus.FINISHED_REPETITION  # ends a prompt like a stop
        req.num_computed_tokens = req.num_prompt_tokens + 3
        delay, params = c.request_finished(req, [7, 8, 9, 10])
        assert delay is True
        assert params["remote_block_ids"] == [7, 8, 9]  # 33 prompt tokens: 3 blocks
        assert params["remote_num_tokens"] == 2 * BLOCK + 1
        assert "pdlib_group_blocks" not in params
        meta = c.build_connector_meta(None)
        assert meta.to_send["p1"].block_ids == [7, 8, 9] and meta.to_send["p1"].state_ids == []
        req2 = Request("p2", [1, 2], SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}), None)
        req2.status = RequestStatus.FINISHED_ABORTED
        assert c.request_finished(req2, [3]) == (False, None)
    finally:
        c.shutdown()


def test_get_transfer_results_of_newer_vllm(connector_module, monkeypatch):
    # base.py @7ba3df63 (after 2026-08-14) adds KVConnectorTransferResults and the worker call
    # get_transfer_results(finished_req_ids): the sets of get_finished, failed loads (also in
    # finished_recving) in failed_recving. The stand-in is 6adad087's, so the class is added
    # here as that revision defines it.
    import dataclasses as dc

    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    @dc.dataclass
    class KVConnectorTransferResults:
        finished_sending: set = dc.field(default_factory=set)
        finished_recving: set = dc.field(default_factory=set)
        failed_recving: set = dc.field(default_factory=set)

    monkeypatch.setattr(base, "KVConnectorTransferResults", KVConnectorTransferResults,
                        raising=False)
    cfg = VllmConfig(model_config=ModelConfig(total_num_kv_heads=HEADS, head_size=DIM),
                     cache_config=CacheConfig(block_size=BLOCK),
                     kv_transfer_config=KVTransferConfig(
                         kv_connector="PdlibConnector", kv_connector_module_path="pdlib.vllm",
                         kv_role="kv_consumer", kv_connector_extra_config={"backend": "fake"}))
    from vllm.v1.kv_cache_interface import KVCacheConfig
    c = connector_module.PdlibConnector(cfg, KVConnectorRole.WORKER,
                                        KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                                      kv_cache_groups=[]))
    c._worker._fail_now("r-failed", [3, 4])  # a load that could not start
    results = c.get_transfer_results(set())
    assert isinstance(results, KVConnectorTransferResults)
    assert results.finished_recving == {"r-failed"} and results.failed_recving == {"r-failed"}
    assert c.get_block_ids_with_load_errors() == {3, 4}
    assert c.get_transfer_results(set()).finished_recving == set()
