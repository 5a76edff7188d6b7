"""Two-process transfers: tests/peer.py is the prefill process, the test process is decode and
checks every byte (UCX over shm and over tcp on lo; the fake backend moves no bytes and checks
the protocol only). Random layouts, chunked sends, TP 2->1, MLA, a mamba state pool, torch and
numpy buffers, a killed peer, a bootstrap address where nothing listens."""

from __future__ import annotations

import time

import pytest

import pdlib
from conftest import UCX_SHM, UCX_TCP, Decode, free_port, needs_ucx, wait_terminal
from kvpattern import Layout


def transfer(peers, layout, backend="fake", backend_options=None, rooms=range(1, 13),
             max_pages=6, max_chunks=3, prefill_tp=1, buffers="numpy", seed=1,
             decode_buffers="numpy", decode_seed=None):
    port = free_port()
    cfg = dict(backend=backend, backend_options=backend_options or {}, bootstrap_port=port,
               tp_size=prefill_tp, layout=layout.__dict__, rooms=list(rooms), seed=seed,
               max_pages=max_pages, max_chunks=max_chunks, concurrency=4, buffers=buffers)
    peer = peers(cfg)
    peer.expect("READY", 30)
    decode = Decode(layout, port, backend, backend_options, buffers=decode_buffers,
                    seed=seed if decode_seed is None else decode_seed,
                    concurrency=4, prefill_tp=prefill_tp)
    try:
        results = decode.run(list(rooms), max_pages, max_chunks, timeout=90)
    finally:
        decode.close()
    failed = {r: reason for r, (state, reason) in results.items()
              if state != pdlib.KVPoll.Success}
    assert not failed, f"failed rooms: {failed}\npeer:\n" + "\n".join(peer.lines)
    peer.expect("DONE", 30)
    assert peer.quit() == 0, "\n".join(peer.lines)
    return results


def test_fake_two_processes_random_layouts(peers):
    transfer(peers, Layout(layers=3, pool_pages=64), rooms=range(1, 31), max_pages=8)


@needs_ucx
@pytest.mark.parametrize("tls", [UCX_SHM, UCX_TCP], ids=["shm", "tcp"])
def test_ucx_byte_checked_chunked(peers, tls):
    transfer(peers, Layout(layers=2, heads=4, head_bytes=64, pool_pages=64), "ucx", tls,
             rooms=range(1, 17), max_pages=8, max_chunks=3)


@needs_ucx
def test_ucx_torch_buffers(peers):
    pytest.importorskip("torch")
    transfer(peers, Layout(layers=2, pool_pages=48), "ucx", UCX_SHM, rooms=range(1, 9),
             buffers="torch", decode_buffers="torch", seed=5)


@needs_ucx
def test_ucx_backend_allocated_pool(peers):
    transfer(peers, Layout(layers=2, pool_pages=48), "ucx", UCX_SHM, rooms=range(1, 9),
             buffers="pool", seed=9)


@needs_ucx
def test_ucx_tp2_to_tp1(peers):
    transfer(peers, Layout(layers=2, heads=4, head_bytes=32, pool_pages=64), "ucx", UCX_SHM,
             rooms=range(1, 11), max_pages=5, max_chunks=2, prefill_tp=2, seed=3)


@needs_ucx
def test_ucx_mla_tp2_to_tp1(peers):
    transfer(peers, Layout(layers=3, head_bytes=96, pool_pages=48, mla=True), "ucx", UCX_SHM,
             rooms=range(1, 9), max_pages=4, max_chunks=2, prefill_tp=2, seed=4)


@needs_ucx
def test_ucx_mamba_state_pool(peers):
    transfer(peers, Layout(layers=2, pool_pages=48, state_buffers=2, state_slots=8,
                           state_item_bytes=256), "ucx", UCX_TCP, rooms=range(1, 9), seed=6)


@needs_ucx
def test_verifier_catches_wrong_bytes(peers):
    # Decode expects another seed's pattern: the check must fail, proving it looks at bytes.
    with pytest.raises(AssertionError, match="differs"):
        transfer(peers, Layout(layers=1, pool_pages=16), "ucx", UCX_SHM, rooms=[1], max_pages=2,
                 decode_seed=99)


def test_killed_prefill_fails_decode_with_a_reason(peers):
    port = free_port()
    layout = Layout(layers=2, pool_pages=32)
    peer = peers(dict(backend="fake", bootstrap_port=port, layout=layout.__dict__,
                      rooms=[1, 2, 3], max_pages=2, hold=True, concurrency=4))
    peer.expect("READY", 30)
    decode = Decode(layout, port, "fake")
    try:
        receivers = [decode.manager.create_receiver(f"127.0.0.1:{port}", r) for r in (1, 2, 3)]
        for i, r in enumerate(receivers):
            r.init([i], None)
        deadline = time.monotonic() + 15
        while any(r.poll() < pdlib.KVPoll.WaitingForInput for r in receivers):
            assert time.monotonic() < deadline, [r.failure_reason() for r in receivers]
            time.sleep(0.01)
        killed_at = time.monotonic()
        peer.kill()
        states = wait_terminal(receivers, timeout=15)
        assert states == [pdlib.KVPoll.Failed] * 3
        assert time.monotonic() - killed_at < 10
        for r in receivers:
            reason = r.failure_reason()
            assert isinstance(reason, pdlib.Error) and f"room {r.room}" in str(reason)
    finally:
        decode.close()


def test_bootstrap_address_where_nothing_listens():
    layout = Layout(layers=2, pool_pages=16)
    decode = Decode(layout, free_port(), "fake")
    try:
        started = time.monotonic()
        r = decode.manager.create_receiver(decode.address, 77)
        r.init([1, 2], None)
        assert wait_terminal([r], timeout=20) == [pdlib.KVPoll.Failed]
        assert time.monotonic() - started < 15  # connect_timeout is 3 s
        reason = r.failure_reason()
        assert reason is not None and "77" in str(reason), reason
    finally:
        decode.close()
