"""pdlib.sglang driven by a replay of SGLang's schedulers (sglang_sched.py: upstream main at
3c69a4c7, 2026-08-22; the newer, undated prefill.py @423bf210 / decode.py @b7e89b39 where a
test says newer_revision): bare SGLang KVArgs and server_args, keyword
senders and receivers, init(prefill_dp_rank) + send_metadata(..., decode_prefix_len=),
should_send_kv_chunk / send(..., num_kv_tokens=) / clear() then get_transfer_metric(), all
polled through poll_and_all_reduce across the TP ranks with SGLang's illegal-state checks.
Every byte decode receives is checked, and every page and row it did not hand over is checked
unchanged. UCX over shared memory."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

import pdlib
from pdlib import sglang as pd
from conftest import HERE, free_port, needs_ucx
from sglang_sched import (
    CLASSES,
    DecodeInstance,
    Model,
    PrefillInstance,
    Spec,
    server_args,
    write_config,
)
from sglang_standin import KVArgs, KVPoll

SUCCESS, FAILED = KVPoll.Success, KVPoll.Failed


@pytest.fixture(autouse=True)
def sglang_env(monkeypatch):
    """pdlib's knobs come from the environment; SGLang's timeouts too (shortened)."""
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "ucx")
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND_OPTIONS", "ucx.tls=shm")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "30")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "1")
    monkeypatch.setenv("PDLIB_SGLANG_CONNECT_TIMEOUT", "5")
    for name in ("PDLIB_SGLANG_KV_PAGES", "PDLIB_SGLANG_TOTAL_KV_HEADS",
                 "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
                 "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def rooms(n: int, seed: int = 1) -> List[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(62) | 1 for _ in range(n)]


def specs(n: int, model: Model, seed: int = 1, max_len: int = 40, **kw: Any) -> List[Spec]:
    rng = random.Random(seed)
    return [Spec(room=r, input_len=rng.randint(1, max_len), **kw) for r in rooms(n, seed)]


class Pair:
    """A bootstrap server, prefill DP ranks of `prefill_tp` scheduler ranks each, and a decode
    instance of `decode_tp` ranks, as SGLang deployments run them."""

    def __init__(self, tmp_path, model: Model, prefill_tp: int = 1, decode_tp: int = 1,
                 prefill_dp: int = 1, config: str = "both", chunk: int = 8, seed: int = 1):
        self.port = free_port()
        # SGLang's prefill starts it (disagg_service.start_disagg_service), keywords.
        self.server = CLASSES["bootstrap_server"](host="127.0.0.1", port=self.port)
        path = write_config(model, str(tmp_path / "model"))
        self.prefill_dp = prefill_dp
        psa = server_args(tp_size=prefill_tp * prefill_dp, dp_size=prefill_dp,
                          enable_dp_attention=prefill_dp > 1,
                          disaggregation_bootstrap_port=self.port,
                          model_path=path if config in ("both", "prefill") else None,
                          load_balance_method="follow_bootstrap_room")
        dsa = server_args(tp_size=decode_tp, disaggregation_bootstrap_port=self.port,
                          model_path=path if config in ("both", "decode") else None)
        self.prefills: List[PrefillInstance] = []
        self.decode: Optional[DecodeInstance] = None
        try:
            self.prefills = [PrefillInstance(model, psa, tp=prefill_tp, dp_rank=d, chunk=chunk,
                                             seed=seed) for d in range(prefill_dp)]
            self.decode = DecodeInstance(model, dsa, self.port, tp=decode_tp, seed=seed)
        except BaseException:
            self.close()
            raise
        for inst in [*self.prefills, self.decode]:
            inst.start()

    def route(self, spec: Spec) -> PrefillInstance:
        """SGLang's DP controller with follow_bootstrap_room, or the router's rank."""
        dp = spec.router_dp_rank if spec.router_dp_rank is not None \
            else spec.misroute_dp_rank if spec.misroute_dp_rank is not None \
            else spec.room % self.prefill_dp
        return self.prefills[dp]

    def run(self, reqs: List[Spec], timeout: float = 60.0, prefill_too: bool = True
            ) -> Dict[int, Any]:
        for spec in reqs:
            self.decode.submit(spec)  # decode first, as with SGLang's router
            self.route(spec).submit(spec)
        want = {s.room for s in reqs}
        deadline = time.monotonic() + timeout
        while True:
            done = set(self.decode.results)
            pdone = set().union(*(p.results for p in self.prefills))
            errors = [e for i in [*self.prefills, self.decode] for e in i.errors]
            assert not errors, "\n".join(errors)
            if want <= done and (not prefill_too or want <= pdone):
                break
            assert time.monotonic() < deadline, (
                f"timed out: decode {len(done & want)}/{len(want)}, prefill "
                f"{len(pdone & want)}/{len(want)}: {self.decode.results}\n{self.describe()}")
            time.sleep(0.01)
        return self.decode.results

    def describe(self) -> str:
        """Where every unfinished request is, for a timeout's message."""
        lines = []
        for sched in self.decode.scheds:
            for name, queue in (("prealloc", sched.queue), ("transfer", sched.transfer_queue)):
                for d in queue:
                    r = d.kv_receiver
                    h = r._handle
                    lines.append(f"decode {sched.rank} {name} {d.req.bootstrap_room}: "
                                 f"poll {r.poll()!r} pdlib "
                                 f"{h.poll() if h is not None else None} reusable "
                                 f"{h.pages_reusable() if h is not None else None}")
        for p in self.prefills:
            lines.append(f"prefill results {p.results}")
        return "\n".join(lines)

    def prefill_results(self) -> Dict[int, Any]:
        out: Dict[int, Any] = {}
        for p in self.prefills:
            out.update(p.results)
        return out

    def close(self) -> None:
        insts = [*self.prefills] + ([self.decode] if self.decode is not None else [])
        for inst in insts:
            inst.stop()
        try:
            for inst in insts:
                if inst.threads:
                    inst.join()
            if self.decode is not None and self.decode.threads:
                self.decode.final_check()
        finally:
            for inst in insts:
                inst.close()
            self.server.close()


@pytest.fixture
def pair(tmp_path):
    made: List[Pair] = []

    def make(model: Model, **kw: Any) -> Pair:
        p = Pair(tmp_path, model, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def all_ok(pair: Pair, reqs: List[Spec]) -> None:
    d = pair.decode.results
    bad = {r: v for r, v in d.items() if v[0] != SUCCESS}
    assert not bad, bad
    p = pair.prefill_results()
    bad = {r: v for r, v in p.items() if v[0] != SUCCESS}
    assert not bad, bad
    assert set(d) == {s.room for s in reqs}


@needs_ucx
def test_gqa_tp1_chunked_with_early_cached_prefix_send(pair):
    model = Model(layers=2, kv_heads=4)
    reqs = specs(10, model, seed=1)
    for s in reqs[:4]:
        s.input_len = max(s.input_len, 25)
        s.prefill_cached_pages = 2  # prefill's radix hit: sent before the forward
    p = pair(model)
    p.run(reqs)
    all_ok(p, reqs)
    assert p.prefills[0].scheds[0].early_syncs[0] >= 4  # _early_send_wait_event honoured
    for room, metric in p.prefills[0].metrics.items():
        assert metric.transfer_total_bytes > 0
        assert metric.transfer_latency_s is not None and metric.alloc_latency_s is not None


@needs_ucx
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_gqa_unequal_tp_decode_without_head_counts(pair, prefill_tp, decode_tp):
    """SGLang's decode KVArgs has no kv_head_num: both sides derive it from the model config."""
    model = Model(layers=2, kv_heads=4)
    reqs = specs(8, model, seed=2 + prefill_tp)
    p = pair(model, prefill_tp=prefill_tp, decode_tp=decode_tp)
    assert not hasattr(p.decode.scheds[0].kv_args, "kv_head_num")
    p.run(reqs)
    all_ok(p, reqs)


@needs_ucx
def test_mla_tp2_to_tp1(pair):
    model = Model(layers=3, mla=True)
    reqs = specs(8, model, seed=4)
    p = pair(model, prefill_tp=2, decode_tp=1)
    p.run(reqs)
    all_ok(p, reqs)


@needs_ucx
def test_decode_prefix(pair):
    """Decode's radix cache holds the first pages: prefill sends only the rest; a prefix that
    covers the whole prompt leaves an empty last chunk (aux only). Decode's prefix pages are
    checked unchanged."""
    model = Model(layers=2, kv_heads=4)
    reqs = specs(9, model, seed=5, max_len=36)
    for i, s in enumerate(reqs):
        pages = -(-s.input_len // model.page_size)
        if i % 3 == 0:
            s.decode_prefix_pages = max(0, pages - 1)
        elif i % 3 == 1:
            s.input_len = 4 * model.page_size
            s.decode_prefix_pages = 4  # the whole prompt
    p = pair(model, prefill_tp=2, decode_tp=1)
    p.run(reqs)
    all_ok(p, reqs)


@needs_ucx
@pytest.mark.parametrize("families,prefill_tp,decode_tp", [
    (("mamba", "swa"), 2, 1),
    (("mamba", "swa", "dsa"), 1, 2),
], ids=["two-families-tp2to1", "three-families-tp1to2"])
def test_state_families(pair, families, prefill_tp, decode_tp):
    model = Model(layers=2, kv_heads=4, families=families)
    reqs = specs(8, model, seed=6, max_len=30)
    reqs[0].decode_prefix_pages = 2
    reqs[0].input_len = 26
    p = pair(model, prefill_tp=prefill_tp, decode_tp=decode_tp)
    args = p.decode.scheds[0].kv_manager.options.args
    assert [f.type for f in args.state_families] == [
        pdlib.StateType.from_name(n) for n in families]
    p.run(reqs)
    all_ok(p, reqs)


@needs_ucx
def test_prefill_dp2(pair):
    """Two prefill DP ranks; SGLang's decode gets the rank from pdlib's PrefillInfo (follow the
    room: pdlib picks room % 2) or from the router (disagg_prefill_dp_rank)."""
    model = Model(layers=2, kv_heads=4)
    reqs = specs(10, model, seed=7)
    for s in reqs[:3]:
        s.router_dp_rank = (s.room + 1) % 2  # not room % 2: only the router's rank finds it
    p = pair(model, prefill_dp=2)
    p.run(reqs)
    all_ok(p, reqs)
    assert all(p.prefills[d].results for d in range(2))


@needs_ucx
def test_refused_pairing_reaches_decode_at_once(pair, monkeypatch):
    """A request that reached prefill DP rank 0 while decode looks for it on DP rank 1 (no
    router rank, room % 2 == 1): prefill refuses it at once, and decode, bound to DP rank 1,
    fails within a second with prefill's reason (relayed by the bootstrap server), not by a
    timeout."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "60")
    model = Model(layers=2, kv_heads=4)
    reqs = specs(3, model, seed=23)
    reqs[0].misroute_dp_rank = (reqs[0].room + 1) % 2
    p = pair(model, prefill_dp=2)
    started = time.monotonic()
    d = p.run(reqs, timeout=30, prefill_too=False)
    state, reason = d[reqs[0].room]
    assert state == FAILED and "but decode looks for it on DP rank" in reason, reason
    assert "DEADLINE_EXCEEDED" not in reason
    assert time.monotonic() - started < 10
    for s in reqs[1:]:
        assert d[s.room][0] == SUCCESS


@needs_ucx
@pytest.mark.parametrize("deferred,newer", [(False, False), (True, False), (True, True)],
                         ids=["plain", "deferred-release", "deferred-release-b7e89b39"])
def test_abort_on_each_side(pair, monkeypatch, deferred, newer):
    """Aborts on either side; with SGLang's deferred release both as main @3c69a4c7 holds pages
    (a decode-initiated abort only) and as decode.py @b7e89b39 (a failed transfer too)."""
    if deferred:
        monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "1")
    import threading
    model = Model(layers=2, kv_heads=4, families=("mamba",), newer_revision=newer)
    reqs = specs(10, model, seed=8, max_len=40)
    reqs[0].prefill_abort = "bootstrap"
    reqs[1].prefill_abort, reqs[1].input_len = "chunk", 37  # after a middle chunk was sent
    reqs[2].decode_abort = "prealloc"
    reqs[3].decode_abort, reqs[3].hold = "transfer", threading.Event()
    p = pair(model, prefill_tp=2, decode_tp=2)
    d = p.run(reqs, prefill_too=True)
    pr = p.prefill_results()
    for s in reqs[:4]:
        assert d[s.room][0] == FAILED, (s, d[s.room])
        assert pr[s.room][0] == FAILED, (s, pr[s.room])
        assert "KVTransferError" in d[s.room][1] or "abort" in d[s.room][1].lower()
    # Each side's abort reached the other at once, with the reason (not a timeout): prefill's
    # before decode was bound too (pdlib keeps the failed room for a late decode), and
    # decode's before it was bound (aborted once bound).
    # (On one decode rank: another may learn of it first through SGLang's all-reduced poll,
    # "failed on another TP rank", before its own prefill rank's word arrives.)
    assert any(pd.ABORT_REASON in r for r in p.decode.reasons[reqs[0].room]), \
        p.decode.reasons[reqs[0].room]
    for s in reqs[:4]:
        assert "DEADLINE_EXCEEDED" not in d[s.room][1] + pr[s.room][1], (d[s.room], pr[s.room])
    for s in reqs[4:]:
        assert d[s.room][0] == SUCCESS and pr[s.room][0] == SUCCESS


@needs_ucx
def test_killed_prefill_process(tmp_path):
    """The prefill runs in another process and holds every request; it is killed while decode
    waits in the transfer queue: decode sees Failed with a reason (not a hang) and its pages,
    released only when pdlib says so, hold what they held."""
    import json

    model = Model(layers=2, kv_heads=4)
    port = free_port()
    server = CLASSES["bootstrap_server"](host="127.0.0.1", port=port)
    path = write_config(model, str(tmp_path / "model"))
    reqs = specs(4, model, seed=9)
    cfg = dict(model=dict(layers=2, kv_heads=4), port=port, model_path=path,
               rooms=[[s.room, s.input_len] for s in reqs], max_seconds=60)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "sglang_prefill_proc.py"),
                             json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    decode = None
    try:
        assert proc.stdout.readline().strip() == "READY"
        decode = DecodeInstance(model, server_args(disaggregation_bootstrap_port=port,
                                                   model_path=path), port)
        decode.start()
        for s in reqs:
            decode.submit(s)
        while True:  # every request handed over: in decode's transfer queue, prefill waits
            line = proc.stdout.readline().strip()
            assert line and not line.startswith("ERROR"), line
            if line == f"WAITING {len(reqs)}":
                break
        deadline = time.monotonic() + 20
        while len(decode.scheds[0].transfer_queue) < len(reqs):
            assert time.monotonic() < deadline, decode.results
            time.sleep(0.01)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while len(decode.results) < len(reqs):
            assert time.monotonic() < deadline, decode.results
            assert not decode.errors, decode.errors
            time.sleep(0.01)
        for s in reqs:
            state, reason = decode.results[s.room]
            assert state == FAILED and "KVTransferError" in reason, reason
    finally:
        if proc.poll() is None:
            proc.kill()
        if decode is not None:
            decode.stop()
            decode.join()
            decode.final_check()
            decode.close()
        server.close()


@needs_ucx
def test_waiting_timeout(pair, monkeypatch):
    """SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT: a request prefill never sends fails on
    both sides with the deadline in the reason."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "2")
    model = Model(layers=2, kv_heads=4)
    reqs = specs(3, model, seed=10)
    reqs[0].hold_forever = True
    p = pair(model)
    d = p.run(reqs, timeout=30)
    assert d[reqs[0].room][0] == FAILED and "DEADLINE_EXCEEDED" in d[reqs[0].room][1]
    assert p.prefill_results()[reqs[0].room][0] == FAILED
    assert all(d[s.room][0] == SUCCESS for s in reqs[1:])


@needs_ucx
def test_busy_prefill_starts_long_after_decode_metadata(pair, monkeypatch):
    """A busy prefill starts a request long after decode's send_metadata. SGLang waits
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT from send_metadata (CommonKVReceiver.
    _check_waiting_timeout); pdlib's own transfer timeout (1 s here: a progress clock, for a
    transfer that started and stopped moving) must not fire first."""
    import threading
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "30")
    monkeypatch.setenv("PDLIB_SGLANG_TRANSFER_TIMEOUT", "1")
    model = Model(layers=2, kv_heads=4)
    reqs = specs(3, model, seed=21)
    reqs[0].hold = threading.Event()
    p = pair(model, prefill_tp=2, decode_tp=2)
    started = time.monotonic()
    threading.Timer(4.0, reqs[0].hold.set).start()  # four times pdlib's transfer timeout
    p.run(reqs, timeout=60)
    all_ok(p, reqs)
    assert time.monotonic() - started > 3.5


def assert_room_check_catches(p: Pair, model: Model, seed: int) -> None:
    """A prefill that writes another request's bootstrap_room is caught by pdlib's room check,
    which names the field."""
    meta = p.prefills[0].scheds[0].pools.meta
    real = meta.set_buf
    meta.set_buf = lambda req: (real(req), meta.bootstrap_room.__setitem__(
        (req.metadata_buffer_index, 0), req.bootstrap_room ^ 2))
    bad = specs(1, model, seed=seed)
    d = p.run(bad)
    meta.set_buf = real
    state, reason = d[bad[0].room]
    assert state == FAILED and "DATA_LOSS" in reason and "bootstrap_room" in reason, reason


@needs_ucx
@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted-in-flight"])
def test_pdlib_kv_checksum_end_to_end(pair, monkeypatch, corrupt):
    """pdlib's own KV digest (PDLIB_SGLANG_CHECKSUM=all, issue #42) under SGLang's schedulers,
    TP 2 -> 1 with a mamba state: clean transfers all succeed with every byte right; with the
    fake backend corrupting one op of every batch, every request fails at decode with pdlib's
    DATA_LOSS through SGLang's failure path (failure_exception), none with wrong bytes."""
    monkeypatch.setenv("PDLIB_SGLANG_CHECKSUM", "all")
    if corrupt:
        monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
        monkeypatch.setenv("PDLIB_SGLANG_BACKEND_OPTIONS", "fake.copy=true,fake.corrupt=page:1")
    model = Model(layers=2, kv_heads=2, families=("mamba",))
    reqs = specs(6, model, seed=21)
    p = pair(model, prefill_tp=2, decode_tp=1)
    d = p.run(reqs)
    if not corrupt:
        all_ok(p, reqs)
        return
    for s in reqs:
        state, reason = d[s.room]
        assert state == FAILED, (s, reason)
        assert "KVTransferError" in reason and "DATA_LOSS" in reason, reason
        assert "KV checksum mismatch" in reason, reason


def test_pdlib_kv_checksum_setting_is_checked(monkeypatch):
    """PDLIB_SGLANG_CHECKSUM takes off, sampled or all; anything else is refused by name."""
    from pdlib._sglang_args import checksum_setting, ConfigError
    assert checksum_setting("ALL", "64", "X") == (pdlib.KvChecksum.All, 64)
    assert checksum_setting("sampled", "8", "X") == (pdlib.KvChecksum.Sampled, 8)
    for mode, every in (("on", "64"), ("all", "0"), ("all", "x")):
        with pytest.raises(ConfigError, match="X"):
            checksum_setting(mode, every, "X")


@needs_ucx
@pytest.mark.parametrize("position", ["before", "after"])
def test_kv_checksum_row_in_either_place_keeps_both_checks(pair, position):
    """SGLang's KV checksum row (set_kv_checksum / get_kv_checksum) before or after
    bootstrap_room: pdlib finds bootstrap_room by what it is (not by position), keeps its room
    check on it, and carries the checksum row like any other, so SGLang's own check works."""
    model = Model(layers=2, kv_heads=2, aux_kv_checksum=position, newer_revision=True)
    reqs = specs(4, model, seed=13)
    p = pair(model)
    sched = p.decode.scheds[0]
    ptrs = sched.kv_args.aux_data_ptrs
    meta = sched.pools.meta
    assert len(ptrs) == 11
    room_at = sched.kv_manager.options.args.aux_room_buffer
    assert ptrs[room_at] == meta.bootstrap_room.ctypes.data
    assert room_at == (10 if position == "before" else 9)
    p.run(reqs)
    all_ok(p, reqs)
    assert_room_check_catches(p, model, seed=14)
    pmeta = p.prefills[0].scheds[0].pools.meta
    # A wrong checksum: pdlib carries the row as it is and SGLang's own comparison catches it.
    real_ck = pmeta.set_kv_checksum
    pmeta.set_kv_checksum = lambda req, value: real_ck(req, value ^ 4)
    bad = specs(1, model, seed=15)
    d = p.run(bad)
    pmeta.set_kv_checksum = real_ck
    assert "KV checksum mismatch" in str(d[bad[0].room]), d[bad[0].room]


@needs_ucx
@pytest.mark.parametrize("dsa_dim,mask_tokens", [(0, 0), (16, 0), (0, 32), (16, 32)],
                         ids=["10-buffers", "11-dsa-topk", "13-sampling-mask", "14-both"])
def test_metadata_buffer_variants_keep_the_room_check(pair, dsa_dim, mask_tokens):
    model = Model(layers=1, kv_heads=2, aux_dsa_dim=dsa_dim, aux_sampling_tokens=mask_tokens)
    reqs = specs(4, model, seed=11)
    p = pair(model)
    n = len(p.decode.scheds[0].kv_args.aux_data_ptrs)
    assert n == 10 + (dsa_dim > 0) + 3 * (mask_tokens > 0)
    assert p.decode.scheds[0].kv_manager.options.args.aux_room_buffer == n - 1
    p.run(reqs)
    all_ok(p, reqs)
    assert_room_check_catches(p, model, seed=12)


@needs_ucx
def test_no_model_config_moves_whole_pages_with_equal_tp(pair):
    model = Model(layers=2, kv_heads=4)
    reqs = specs(6, model, seed=13)
    p = pair(model, prefill_tp=2, decode_tp=2, config="none")
    assert p.decode.scheds[0].kv_manager.options.args.kv_head_num == 0  # opaque pages
    p.run(reqs)
    all_ok(p, reqs)


@needs_ucx
@pytest.mark.parametrize("config", ["none", "prefill"])
def test_unequal_tp_without_config_is_refused_naming_it(pair, config):
    model = Model(layers=2, kv_heads=4)
    reqs = specs(2, model, seed=14)
    p = pair(model, prefill_tp=2, decode_tp=1, config=config)
    d = p.run(reqs, timeout=40, prefill_too=False)
    for s in reqs:
        state, reason = d[s.room]
        assert state == FAILED and "no model config" in reason or (
            "moves KV pages whole" in reason and "model_path" in reason), reason


@needs_ucx
@pytest.mark.parametrize("newer", [False, True], ids=["3c69a4c7", "423bf210"])
def test_draft_model_buffers_appended(pair, newer):
    """The draft model's K/V buffers after the target's: main @3c69a4c7 says nothing more (they
    are more layers to pdlib), prefill.py @423bf210 counts them in num_draft_entries."""
    model = Model(layers=2, kv_heads=4, draft_layers=1, newer_revision=newer)
    reqs = specs(6, model, seed=15)
    p = pair(model, prefill_tp=1, decode_tp=2)
    assert getattr(p.decode.scheds[0].kv_args, "num_draft_entries", None) == (2 if newer
                                                                              else None)
    p.run(reqs)
    all_ok(p, reqs)


# ------------------------------------------------------------------ the adapter on its own
def bare_args(pools=None, heads: Optional[int] = None, **kw: Any) -> KVArgs:
    """A decode-shaped SGLang KVArgs over small numpy pools."""
    kv = pools if pools is not None else [np.zeros((8, 4, 2, 16), np.uint8) for _ in range(4)]
    aux = [np.zeros((4, 64), np.uint8)]
    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank = 0, 0, 0
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [b[0].nbytes for b in kv]
    a.aux_data_ptrs, a.aux_data_lens = [b.ctypes.data for b in aux], [b.nbytes for b in aux]
    a.aux_item_lens = [b[0].nbytes for b in aux]
    a.page_size, a.gpu_id, a.ib_device = 4, 0, None
    a.state_types = []
    if heads is not None:
        a.kv_head_num, a.total_kv_head_num = heads, heads
    a._keep = (kv, aux)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("change,match", [
    (dict(state_types=["block_scale"], state_data_ptrs=[[1]], state_data_lens=[[64]],
          state_item_lens=[[8]]), "block_scale.*another transfer backend"),
    (dict(state_types=["dsa_tail"], state_data_ptrs=[[1]], state_data_lens=[[64]],
          state_item_lens=[[8]]), "dsa_tail"),
    (dict(num_draft_entries=2, kv_item_lens=None), "draft model's KV pages"),
], ids=["block-scale", "dsa-tail", "draft-item-len"])
def test_refused_kv_args_say_why(monkeypatch, change, match):
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
    monkeypatch.setenv("PDLIB_SGLANG_TOTAL_KV_HEADS", "2")  # KV pages described by head
    a = bare_args(heads=2, **{k: v for k, v in change.items() if v is not None})
    if change.get("kv_item_lens", 0) is None:
        a.kv_item_lens = [a.kv_item_lens[0]] * 2 + [a.kv_item_lens[0] // 2] * 2
    with pytest.raises(pd.ConfigError, match=match):
        pd.KVManager(a, pd.DisaggregationMode.DECODE, server_args(), False)


@pytest.mark.parametrize("sa,env,match", [
    (dict(pp_size=2), {}, "decode with pipeline parallelism"),
    (dict(disaggregation_decode_allocation_policy="prefill_complete"), {}, "prefill_complete"),
    (dict(), {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}, "unset it"),
    (dict(device="npu"), {}, "host or CUDA"),
    (dict(attn_cp_size=2), {}, "context parallelism"),
], ids=["decode-pp", "prefill-complete", "force-query", "npu", "attn-cp"])
def test_refused_server_args_say_why(monkeypatch, sa, env, match):
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(pd.ConfigError, match=match):
        pd.KVManager(bare_args(heads=2), pd.DisaggregationMode.DECODE, server_args(**sa), False)


class StubHandle:
    """A pdlib handle whose state and page-reuse answer the test sets."""

    def __init__(self):
        self.state, self.reusable, self.closed, self.aborted = KVPoll.Bootstrapping, True, \
            False, None

    def poll(self):
        return pdlib.KVPoll(self.state)

    def pages_reusable(self):
        return self.reusable

    def failure_reason(self):
        if self.state != KVPoll.Failed:
            return None
        return pdlib.AbortedError("ABORTED: stub", int(pdlib.StatusCode.Aborted), "stub")

    def abort(self, reason):
        self.aborted = reason
        self.state = KVPoll.Failed

    def close(self):
        self.closed = True

    def init(self, *a, **kw):
        pass


def test_failed_is_not_reported_before_the_pages_are_reusable():
    s = pd.KVSender.__new__(pd.KVSender)
    s.handle, s.bootstrap_room = StubHandle(), 5
    s.handle.state, s.handle.reusable = KVPoll.Failed, False
    assert s.poll() == pdlib.KVPoll.Bootstrapping  # nothing handed over: bootstrap queue state
    s._handed_over = True
    assert s.poll() == pdlib.KVPoll.Transferring  # the inflight queue waits
    s.handle.reusable = True
    assert s.poll() == pdlib.KVPoll.Failed


def test_failure_from_another_rank_aborts_this_one():
    r = pd.KVReceiver.__new__(pd.KVReceiver)
    r._handle, r.bootstrap_room, r._created = StubHandle(), 9, True
    r._handle.state = KVPoll.Transferring
    with pytest.raises(pd.KVTransferError) as e:
        r.failure_exception()
    assert e.value.is_from_another_rank and "another TP rank" in str(e.value)
    assert r._handle.aborted


def test_sender_and_receiver_calls_without_a_transfer(monkeypatch):
    """The calls SGLang makes whose answers do not need a peer."""
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
    port = free_port()
    server = pd.KVBootstrapServer(host="127.0.0.1", port=port)
    pools = [np.zeros((8, 4, 2, 16), np.uint8) for _ in range(4)]
    prefill = pd.KVManager(bare_args(pools, heads=2), pd.DisaggregationMode.PREFILL,
                           server_args(disaggregation_bootstrap_port=port), False)
    decode = pd.KVManager(bare_args(heads=None), pd.DisaggregationMode.DECODE,
                          server_args(disaggregation_bootstrap_port=port), False)
    try:
        assert decode.enable_deferred_decode_kv_release and not prefill.is_dummy_cp_rank
        assert decode.try_ensure_parallel_info(f"127.0.0.1:{port}") is True
        info = decode.prefill_info_table.get(f"127.0.0.1:{port}")
        assert info.dp_size != 1 and info.follow_bootstrap_room
        assert isinstance(12345 % info.dp_size, pd._RoomAsDPRank)
        s = CLASSES["sender"](mgr=prefill, bootstrap_addr=f"127.0.0.1:{port}",
                              bootstrap_room=77, dest_tp_ranks=[0], pp_rank=0,
                              req_has_disagg_prefill_dp_rank=False)
        assert s.get_max_transfer_tokens() is None
        assert s.should_send_kv_chunk(0, True) and not s.should_send_kv_chunk(0, False)
        assert s.pop_decode_prefix_len() == 0  # before WaitingForInput
        r = CLASSES["receiver"](mgr=decode, bootstrap_addr=f"127.0.0.1:{port}",
                                bootstrap_room=77)
        assert r.poll() == pdlib.KVPoll.Bootstrapping and r.conclude_state is None
        r.init(77 % info.dp_size)
        deadline = time.monotonic() + 10
        while r.poll() != pdlib.KVPoll.WaitingForInput:  # bound: SGLang pre-allocates now
            assert time.monotonic() < deadline, (r.poll(), s.poll())
            time.sleep(0.002)
        r.send_metadata(np.array([1, 2], np.int32), 0, [], decode_prefix_len=4)
        while s.poll() != pdlib.KVPoll.WaitingForInput:
            assert time.monotonic() < deadline, s.poll()
            time.sleep(0.002)
        assert s.pop_decode_prefix_len() == 4
        s.init(2, 0)
        # The third argument: positional, num_kv_tokens= or token_position_offset=.
        s.send(np.array([3], np.int64), None, 4)
        s.send(np.array([5], np.int32), [], token_position_offset=8)
        while s.poll() != pdlib.KVPoll.Success or r.poll() != pdlib.KVPoll.Success:
            assert time.monotonic() < deadline, (s.poll(), r.poll())
            time.sleep(0.002)
        s.clear()
        metric = s.get_transfer_metric()  # after clear(), as SGLang reads it
        assert metric.transfer_total_bytes == 2 * 4 * (4 * 2 * 16) + 64  # 2 pages x 4 buffers + aux
        assert metric.transfer_latency_s is not None and metric.alloc_latency_s is not None
        r.clear()
        # Errors do not raise: they fail the request with the reason.
        s2 = CLASSES["sender"](mgr=prefill, bootstrap_addr=f"127.0.0.1:{port}",
                               bootstrap_room=78, dest_tp_ranks=[0], pp_rank=0)
        s2.init(1, 0)
        s2.send(np.array([1.5]))
        assert s2.poll() == pdlib.KVPoll.Failed
        with pytest.raises(pd.KVTransferError, match="expected integers"):
            s2.failure_exception()
        r2 = CLASSES["receiver"](mgr=decode, bootstrap_addr=f"127.0.0.1:{port}",
                                 bootstrap_room=79)
        r2.abort()  # before init: no receiver is created
        assert r2.poll() == pdlib.KVPoll.Failed
        with pytest.raises(pd.KVTransferError, match=pd.ABORT_REASON):
            r2.failure_exception()
        r2.init(0)
        assert r2.poll() == pdlib.KVPoll.Failed
        r2.clear()
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_room_on_the_wrong_prefill_dp_rank_fails_saying_how_to_route(monkeypatch):
    """pdlib's decode looks for a room on prefill DP rank room % dp_size unless the router gave
    one; a prefill DP rank that gets someone else's room fails it with the remedy."""
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
    port = free_port()
    server = pd.KVBootstrapServer(host="127.0.0.1", port=port)
    sa = server_args(disaggregation_bootstrap_port=port, tp_size=2, dp_size=2,
                     enable_dp_attention=True)
    prefill = pd.KVManager(bare_args(heads=2, engine_rank=1, system_dp_rank=1),
                           pd.DisaggregationMode.PREFILL, sa, False)
    try:
        ok = pd.KVSender(mgr=prefill, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=11,
                         dest_tp_ranks=[1], pp_rank=0)
        routed = pd.KVSender(mgr=prefill, bootstrap_addr=f"127.0.0.1:{port}",
                             bootstrap_room=12, dest_tp_ranks=[1], pp_rank=0,
                             req_has_disagg_prefill_dp_rank=True)
        wrong = pd.KVSender(mgr=prefill, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=14,
                            dest_tp_ranks=[1], pp_rank=0)
        assert ok.poll() == routed.poll() == pdlib.KVPoll.Bootstrapping
        assert wrong.poll() == pdlib.KVPoll.Failed
        with pytest.raises(pd.KVTransferError, match="follow_bootstrap_room"):
            wrong.failure_exception()
    finally:
        prefill.close()
        server.close()


def test_prefill_pp_stage_layers_from_the_config(monkeypatch, tmp_path):
    """Prefill PP with an uneven split (3 layers: 2 + 1): each stage gets its start layer from
    SGLang's prefill_start_layer and the model's layers from the config; a stage whose
    prefill_end_layer disagrees with its buffers is refused."""
    monkeypatch.setenv("PDLIB_SGLANG_BACKEND", "fake")
    model = Model(layers=3, kv_heads=2)
    path = write_config(model, str(tmp_path / "m"))
    port = free_port()
    server = pd.KVBootstrapServer(host="127.0.0.1", port=port)
    made = []
    try:
        for pp_rank, (start, layers) in enumerate([(0, 2), (2, 1)]):
            pools = [np.zeros((8, 4, 2, 16), np.uint8) for _ in range(2 * layers)]
            a = bare_args(pools, heads=2, pp_rank=pp_rank, prefill_start_layer=start,
                          prefill_end_layer=start + layers)
            m = pd.KVManager(a, pd.DisaggregationMode.PREFILL, server_args(
                pp_size=2, model_path=path, disaggregation_bootstrap_port=port), False)
            made.append(m)
            assert m.options.args.prefill_start_layer == start
            assert m.options.args.fingerprint.num_layers == 3
        pools = [np.zeros((8, 4, 2, 16), np.uint8) for _ in range(2)]
        a = bare_args(pools, heads=2, pp_rank=1, prefill_start_layer=2, prefill_end_layer=4)
        with pytest.raises(pd.ConfigError, match=r"layers \[2, 4\) but 1 KV layers"):
            pd.KVManager(a, pd.DisaggregationMode.PREFILL, server_args(
                pp_size=2, model_path=path, disaggregation_bootstrap_port=port), False)
    finally:
        for m in made:
            m.close()
        server.close()
