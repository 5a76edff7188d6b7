"""pdlib.sglang driven the way SGLang's schedulers drive a transfer backend (sglang_sched.py):
full transfers (fake, and UCX with every byte checked), chunked prefill, TP 2->1 and 1->2,
MLA, a mamba state pool, abort, a killed prefill process, a bootstrap address where nothing
listens, and the adapter's own input handling."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pdlib
from pdlib import sglang as pd
from conftest import UCX_SHM, UCX_TCP, free_port, needs_ucx, wait_for
from kvpattern import Layout
from sglang_sched import DecodeScheduler, PrefillRank, PrefillScheduler, ServerArgs


def run_pair(layout, backend="fake", backend_options=None, rooms=range(1, 9), pages=(1, 6),
             chunks=1, prefill_tp=1, decode_tp=1, abort_rooms=(), seed=1, timeout=60.0):
    port = free_port()
    server = pd.KVBootstrapServer("127.0.0.1", port)
    common = dict(disaggregation_bootstrap_port=port, pdlib_backend=backend,
                  pdlib_backend_options=dict(backend_options or {}))
    prefill_ranks = [PrefillRank(layout, ServerArgs(tp_size=prefill_tp, **common), r, seed)
                     for r in range(prefill_tp)]
    addr = f"127.0.0.1:{port}"
    prefill = PrefillScheduler(prefill_ranks, addr, chunks, set(abort_rooms))
    decode = DecodeScheduler(layout, ServerArgs(tp_size=decode_tp, **common), addr, seed)
    rng = np.random.default_rng(seed)
    try:
        for room in rooms:
            n = int(rng.integers(pages[0], pages[1] + 1))
            decode.add(room, n)  # decode learns of the request first, as with SGLang's router
            prefill.add(room, n)
        deadline = time.monotonic() + timeout
        while not decode.idle() or prefill.bootstrap or prefill.waiting or prefill.inflight:
            assert time.monotonic() < deadline, (decode.done, prefill.done)
            prefill.step()
            decode.step()
            time.sleep(0.0005)
        return prefill, decode
    finally:
        decode.close()
        for r in prefill_ranks:
            r.mgr.close()
        server.close()


def all_succeeded(prefill, decode, rooms):
    assert decode.done == {r: pdlib.KVPoll.Success for r in rooms}, decode.errors
    assert prefill.done == {r: pdlib.KVPoll.Success for r in rooms}, prefill.errors


def test_fake_scheduler_flow():
    p, d = run_pair(Layout(layers=2), rooms=range(1, 21), chunks=3)
    all_succeeded(p, d, range(1, 21))


@needs_ucx
@pytest.mark.parametrize("tls", [UCX_SHM, UCX_TCP], ids=["shm", "tcp"])
def test_ucx_chunked_byte_checked(tls):
    p, d = run_pair(Layout(layers=2, heads=4, head_bytes=64), "ucx", tls, rooms=range(1, 11),
                    pages=(1, 8), chunks=3)
    all_succeeded(p, d, range(1, 11))


@needs_ucx
def test_ucx_tp2_to_tp1_and_tp1_to_tp2():
    p, d = run_pair(Layout(layers=2, heads=4), "ucx", UCX_SHM, rooms=range(1, 7), prefill_tp=2)
    all_succeeded(p, d, range(1, 7))
    p, d = run_pair(Layout(layers=2, heads=4), "ucx", UCX_SHM, rooms=range(1, 7), decode_tp=2,
                    seed=2)
    all_succeeded(p, d, range(1, 7))


@needs_ucx
def test_ucx_mla_and_mamba_state():
    p, d = run_pair(Layout(layers=3, head_bytes=64, mla=True), "ucx", UCX_SHM,
                    rooms=range(1, 7), prefill_tp=2, seed=3)
    all_succeeded(p, d, range(1, 7))
    p, d = run_pair(Layout(layers=2, state_buffers=2, state_item_bytes=128), "ucx", UCX_SHM,
                    rooms=range(1, 7), seed=4)
    all_succeeded(p, d, range(1, 7))


def test_abort_reaches_both_schedulers_with_the_reason():
    p, d = run_pair(Layout(layers=2), rooms=range(1, 7), abort_rooms={2, 5})
    for room in (2, 5):
        assert p.done[room] == pdlib.KVPoll.Failed and d.done[room] == pdlib.KVPoll.Failed
        assert "aborted by the SGLang scheduler" in p.errors[room]
        assert "aborted by the SGLang scheduler" in d.errors[room], d.errors
        assert str(room) in d.errors[room]
    for room in (1, 3, 4, 6):
        assert d.done[room] == pdlib.KVPoll.Success


def test_bootstrap_address_where_nothing_listens():
    layout = Layout(layers=2)
    port = free_port()
    decode = DecodeScheduler(layout, ServerArgs(disaggregation_bootstrap_port=port),
                             f"127.0.0.1:{port}", seed=1)
    try:
        decode.add(9, 2)
        wait_for(lambda: (decode.step(), decode.idle())[1], 20, "decode to give up")
        assert decode.done[9] == pdlib.KVPoll.Failed
        assert "KVTransferError(bootstrap_room=9)" in decode.errors[9]
    finally:
        decode.close()


def test_killed_prefill_process(peers):
    """The prefill is another process (peer.py, pdlib's own API) that never sends; it is
    killed and SGLang's decode flow sees Failed with a reason, not a hang."""
    port = free_port()
    layout = Layout(layers=2)
    peer = peers(dict(backend="fake", bootstrap_port=port, layout=layout.__dict__,
                      rooms=[1, 2], max_pages=2, hold=True,
                      model_name="pdlib-sglang-test"))
    peer.expect("READY", 30)
    decode = DecodeScheduler(layout, ServerArgs(disaggregation_bootstrap_port=port),
                             f"127.0.0.1:{port}", seed=1)
    try:
        decode.add(1, 1)
        decode.add(2, 2)
        wait_for(lambda: (decode.step(), not decode.prealloc)[1], 15, "pre-allocation")
        assert not decode.done, decode.errors  # both rooms connected and waiting for KV
        peer.kill()
        wait_for(lambda: (decode.step(), decode.idle())[1], 15, "decode to fail the rooms")
        assert decode.done == {1: pdlib.KVPoll.Failed, 2: pdlib.KVPoll.Failed}
        assert all("KVTransferError" in e for e in decode.errors.values())
    finally:
        decode.close()


def test_adapter_inputs_and_failures():
    port = free_port()
    server = pd.KVBootstrapServer("127.0.0.1", port)
    assert server.port == port
    layout = Layout(layers=2)
    sa = ServerArgs(disaggregation_bootstrap_port=port)
    prefill = PrefillRank(layout, sa, 0, 1)
    decode = DecodeScheduler(layout, sa, f"127.0.0.1:{port}", 1)
    try:
        with pytest.raises(ValueError):
            pd.KVManager(pd.KVArgs(), "null", sa)
        s = pd.KVSender(prefill.mgr, f"127.0.0.1:{port}", 5, [0], 0)
        r = pd.KVReceiver(decode.ranks[0]["mgr"], f"127.0.0.1:{port}", 5)
        r.init(np.array([1, 2], np.int64), 0)  # int64 is converted, as SGLang may pass it
        wait_for(lambda: s.poll() == pdlib.KVPoll.WaitingForInput, 10, "WaitingForInput")
        s.init(2, 0)
        s.send(np.array([3], np.int64))
        assert s.curr_idx == 1 and s.poll() != pdlib.KVPoll.Failed
        s.send(np.array([70000], np.int32))  # out of range: fails the request, no raise
        wait_for(lambda: s.poll() == pdlib.KVPoll.Failed, 10, "Failed")
        with pytest.raises(pd.KVTransferError) as e:
            s.failure_exception()
        assert e.value.bootstrap_room == 5 and "70000" in e.value.failure_reason
        assert isinstance(e.value, pdlib.Error)
        with pytest.raises(TypeError):
            s.send(np.array([1.5]))
        r2 = pd.KVReceiver(decode.ranks[0]["mgr"], f"127.0.0.1:{port}", 6)
        r2.init(0)  # the newer two-step shape: init(prefill_dp_rank), then send_metadata
        r2.send_metadata([4, 5], 1)
        r2.abort()
        wait_for(lambda: r2.poll() == pdlib.KVPoll.Failed, 5, "Failed")
        with pytest.raises(pd.KVTransferError, match="aborted by the SGLang scheduler"):
            r2.failure_exception()
        assert pd.KVPoll.Success == 4 and pd.KVPoll is pdlib.KVPoll
    finally:
        decode.close()
        prefill.mgr.close()
        server.close()
