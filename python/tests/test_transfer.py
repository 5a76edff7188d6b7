"""Two-process transfers: tests/peer.py is the prefill process, the test process is decode and
checks every byte (UCX over shm and over tcp on lo; the fake backend moves no bytes and checks
the protocol only). Random layouts, chunked sends, TP 2->1, MLA, a mamba state pool, torch and
numpy buffers, a killed peer, a bootstrap address where nothing listens. Then, in one process
(in-process control plane, UCX shm), byte-checked too: decode prefixes (prefill sends only the
pages after decode's prefix; decode's other pages stay as they were) and two state families
given as lists of lists."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

import pdlib
from conftest import UCX_SHM, UCX_TCP, Decode, free_port, needs_ucx, wait_for, wait_terminal
from kvpattern import Layout, aux_token, full_page


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


# --- One process: decode prefixes and several state families ------------------------------------
# A prefill and a decode manager of this process (in-process control plane) over UCX shm. Every
# buffer of both sides starts as a background pattern; prefill's source pages/slots then get the
# test pattern of their position in the request. Decode checks that the indices it handed over
# hold the pattern and that every other page, slot and row of it (the prefix pages included)
# still holds its background, byte for byte.

PAGE_SIZE = 4  # tokens per page
HEADS, HEAD_BYTES, LAYERS = 2, 16, 2
PAGE_BYTES = HEADS * PAGE_SIZE * HEAD_BYTES
POOL_PAGES = 24
BACKGROUND_SEED = 4242
FAMILY_BASE = 1 << 21  # pattern "buffer" of state family f, buffer b: FAMILY_BASE + 64 f + b


def _background(side: int, what: int, index: int, shape) -> np.ndarray:
    rng = np.random.default_rng([BACKGROUND_SEED, side, what, index])
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _rows(indices):
    """A family's index list as ints (None: the family takes no part)."""
    return [] if indices is None else [int(i) for i in indices]


class InProcessPair:
    """prefill and decode managers of one process. `families`: (StateType, buffers, rows,
    row_bytes) per state family; `shorthand`: declare a single family through the one-family
    fields (state, state_type) instead of state_families."""

    def __init__(self, families=(), shorthand=False, backend="ucx", backend_options=None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.families = list(families)
        self.sides = {}
        self.managers = {}
        for side, mode in enumerate((pdlib.Mode.Prefill, pdlib.Mode.Decode)):
            bufs = dict(kv=[], state=[], aux=pdlib.MetadataBuffers(8))
            o = pdlib.KVManagerOptions(mode=mode, backend=backend,
                                       backend_options=dict(backend_options or UCX_SHM),
                                       control_plane=pdlib.ControlPlane.InProcess)
            for b in range(2 * LAYERS):
                buf = _background(side, b, 0, (POOL_PAGES, PAGE_BYTES))
                bufs["kv"].append(buf)
                o.args.kv.add(buf)
            for f, (kind, count, rows, row_bytes) in enumerate(self.families):
                family = pdlib.StateFamily(type=kind)
                arrays = []
                for b in range(count):
                    arrays.append(_background(side, FAMILY_BASE + 64 * f + b, 0,
                                              (rows, row_bytes)))
                    family.buffers.add(arrays[-1])
                bufs["state"].append(arrays)
                if shorthand:
                    assert len(self.families) == 1
                    o.args.state, o.args.state_type = family.buffers, kind
                else:
                    o.args.state_families.append(family)
            o.args.aux = bufs["aux"].describe()
            o.args.page_size = PAGE_SIZE
            o.args.kv_head_num = HEADS
            o.args.kv_layout = pdlib.KVLayout.HND
            o.args.fingerprint = pdlib.ModelFingerprint(LAYERS, HEADS, HEAD_BYTES, 1, 1,
                                                        "pdlib-python-prefix")
            o.bootstrap_port = self.port
            o.start_bootstrap_server = mode == pdlib.Mode.Prefill
            o.liveness_timeout = 2.0
            o.connect_timeout = 3.0
            self.sides[mode] = bufs
            self.managers[mode] = pdlib.KVManager.create(o)
        self.prefill = self.managers[pdlib.Mode.Prefill]
        self.decode = self.managers[pdlib.Mode.Decode]
        self.p = self.sides[pdlib.Mode.Prefill]
        self.d = self.sides[pdlib.Mode.Decode]
        # Decode's own copy, to tell what changed.
        self.d_kv_before = [b.copy() for b in self.d["kv"]]
        self.d_state_before = [[b.copy() for b in fam] for fam in self.d["state"]]

    def close(self):
        self.decode.close()
        self.prefill.close()

    def fill_source(self, room, src_pages, src_state):
        """Prefill's request: page position k of the prompt in src_pages[k], family f's i-th
        index in src_state[f][i]."""
        for b, buf in enumerate(self.p["kv"]):
            for pos, page in enumerate(src_pages):
                buf[page] = full_page(1, room, b, pos, PAGE_BYTES)
        for f, fam in enumerate(self.p["state"]):
            for b, buf in enumerate(fam):
                for i, row in enumerate(_rows(src_state[f])):
                    buf[row] = full_page(1, room, FAMILY_BASE + 64 * f + b, i, buf.shape[1])

    def verify(self, room, first_pos, dst_pages, dst_state):
        """Decode's pages hold prompt positions first_pos.. in order, family f's rows
        dst_state[f] its pattern; everything else is as it was."""
        for b, buf in enumerate(self.d["kv"]):
            expected = self.d_kv_before[b].copy()
            for k, page in enumerate(dst_pages):
                expected[page] = full_page(1, room, b, first_pos + k, PAGE_BYTES)
            for page in range(POOL_PAGES):
                assert np.array_equal(buf[page], expected[page]), (
                    f"room {room}: kv buffer {b} page {page} "
                    + (f"(position {first_pos + dst_pages.index(page)})"
                       if page in dst_pages else "(not handed over)") + " differs")
        for f, fam in enumerate(self.d["state"]):
            for b, buf in enumerate(fam):
                expected = self.d_state_before[f][b].copy()
                for i, row in enumerate(_rows(dst_state[f])):
                    expected[row] = full_page(1, room, FAMILY_BASE + 64 * f + b, i, buf.shape[1])
                for row in range(buf.shape[0]):
                    assert np.array_equal(buf[row], expected[row]), (
                        f"room {room}: state family {f} buffer {b} row {row} differs")
        self.d_kv_before = [b.copy() for b in self.d["kv"]]
        self.d_state_before = [[b.copy() for b in fam] for fam in self.d["state"]]


@pytest.fixture
def inproc():
    made = []

    def make(*args, **kwargs):
        pair = InProcessPair(*args, **kwargs)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def run_request(pair, room, prompt_len, prefix, src_state, dst_state, chunks=2,
                flat_state=False, layerwise=False):
    """One request with a decode prefix of `prefix` tokens; returns decode's pages."""
    rng = random.Random(room)
    total = -(-prompt_len // PAGE_SIZE)
    prefix_pages = prefix // PAGE_SIZE
    src_pages = rng.sample(range(POOL_PAGES), total)
    # Decode already holds the prefix in pages of its own (never handed over: must stay as they
    # are); it hands pages for the rest.
    picked = rng.sample(range(POOL_PAGES), total)
    decode_prefix_pages, dst_pages = picked[:prefix_pages], picked[prefix_pages:]
    pair.fill_source(room, src_pages, src_state)

    sender = pair.prefill.create_sender(room)
    assert sender.decode_prefix_len is None  # not known before WaitingForInput
    with pytest.raises(pdlib.FailedPreconditionError, match="WaitingForInput"):
        sender.pages_after_prefix(prompt_len)
    receiver = pair.decode.create_receiver(pair.address, room)
    receiver.init(np.asarray(dst_pages, np.int32), 1,
                  dst_state[0] if flat_state else dst_state,
                  decode_prefix_len=prefix, prompt_len=prompt_len)
    wait_for(lambda: sender.poll() >= pdlib.KVPoll.WaitingForInput, 10, "WaitingForInput")
    assert sender.poll() == pdlib.KVPoll.WaitingForInput, sender.failure_reason()
    assert sender.decode_prefix_len == prefix
    pages = sender.pages_after_prefix(prompt_len)
    assert pages == len(dst_pages) == total - prefix_pages
    if prefix:
        with pytest.raises(pdlib.OutOfRangeError, match=f"decode_prefix_len {prefix} is longer "
                           f"than the prompt's {prefix - 1} tokens"):
            sender.pages_after_prefix(prefix - 1)  # a prompt shorter than decode's prefix

    pair.p["aux"].output_ids[2, 0] = aux_token(room)
    pair.p["aux"].bootstrap_room[2, 0] = room
    sender.init(pages, 2)
    to_send = src_pages[prefix_pages:]  # the pages after the prefix, in prompt order
    state = src_state[0] if flat_state else src_state
    cut = [len(to_send) * c // chunks for c in range(chunks + 1)]
    if chunks > 1 and len(to_send) > 1:
        for c in range(chunks - 1):
            sender.send(np.asarray(to_send[cut[c]:cut[c + 1]], np.int32), False)
        sender.send(to_send[cut[chunks - 1]:], True, state)
    elif layerwise:
        # The last chunk layer by layer; the call that completes it sends aux and state.
        sender.send_layers(to_send, 1, True, state)
        sender.send_layers(to_send, sender.num_layers, True, state)
    else:
        sender.send(to_send, True, state)  # an empty list: only aux and state move
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2, \
        (sender.failure_reason(), receiver.failure_reason())
    pair.verify(room, prefix_pages, dst_pages, dst_state)
    assert int(pair.d["aux"].output_ids[1, 0]) == aux_token(room)
    for page in decode_prefix_pages:
        assert page not in dst_pages
    sender.close()
    receiver.close()
    return dst_pages


@needs_ucx
@pytest.mark.parametrize("prompt_len,prefix", [(22, 0), (22, 4), (22, 12), (22, 20), (24, 24)],
                         ids=["none", "one_page", "three_pages", "all_but_partial", "all_pages"])
def test_decode_prefix_sends_only_the_pages_after_it(inproc, prompt_len, prefix):
    pair = inproc([(pdlib.StateType.Mamba, 2, 6, 48)], shorthand=True)
    run_request(pair, 31, prompt_len, prefix, [[3]], [[5]], chunks=2, flat_state=True)
    # A second request on the same managers: nothing of the first leaks into it.
    run_request(pair, 32, prompt_len, prefix, [[1]], [[2]], chunks=1, flat_state=True)
    m = pair.prefill.metrics()
    assert m["pages_transferred"] == 2 * (-(-prompt_len // PAGE_SIZE) - prefix // PAGE_SIZE)


@needs_ucx
def test_decode_prefix_errors_name_both_numbers(inproc):
    pair = inproc()
    sender = pair.prefill.create_sender(40)
    r = pair.decode.create_receiver(pair.address, 40)
    with pytest.raises(pdlib.InvalidArgumentError,
                       match=r"decode_prefix_len 6 is not a multiple of page_size 4"):
        r.init([1, 2, 3, 4], None, decode_prefix_len=6, prompt_len=22)
    with pytest.raises(pdlib.OutOfRangeError,
                       match=r"decode_prefix_len 24 is longer than the prompt's 22 tokens"):
        r.init([], None, decode_prefix_len=24, prompt_len=22)
    with pytest.raises(pdlib.InvalidArgumentError, match=r"3 kv pages given for tokens \[8, 22\)"
                       r": expected 4 pages"):
        r.init([1, 2, 3], None, decode_prefix_len=8, prompt_len=22)
    with pytest.raises(pdlib.OutOfRangeError, match="decode_prefix_len"):
        r.init([1], None, decode_prefix_len=-4)
    with pytest.raises(TypeError, match="prompt_len"):
        r.init([1], None, decode_prefix_len=0, prompt_len="22")
    with pytest.raises(TypeError):
        r.init([1], None, None, 4)  # decode_prefix_len is keyword-only
    # Nothing was sent: the receiver still takes a valid init(), and prefill learns its prefix.
    r.init([1, 2, 3, 4], None, decode_prefix_len=8, prompt_len=22)
    wait_for(lambda: sender.poll() >= pdlib.KVPoll.WaitingForInput, 10, "WaitingForInput")
    assert sender.decode_prefix_len == 8
    with pytest.raises(pdlib.OutOfRangeError,
                       match=r"decode_prefix_len 8 is longer than the prompt's 7 tokens"):
        sender.pages_after_prefix(7)
    assert sender.pages_after_prefix(8) == 0 and sender.pages_after_prefix(9) == 1
    with pytest.raises(pdlib.OutOfRangeError, match="prompt_len"):
        sender.pages_after_prefix(-1)
    sender.abort("test over")
    assert wait_terminal([sender, r]) == [pdlib.KVPoll.Failed] * 2
    sender.close()
    with pytest.raises(pdlib.ClosedError):
        sender.pages_after_prefix(8)
    with pytest.raises(pdlib.ClosedError):
        _ = sender.decode_prefix_len


@needs_ucx
@pytest.mark.parametrize("prefix", [0, 8])
def test_two_state_families_as_lists_of_lists(inproc, prefix):
    # mamba: one slot per request (2 buffers); swa: the window's pages (1 buffer, other rows).
    pair = inproc([(pdlib.StateType.Mamba, 2, 6, 96), (pdlib.StateType.Swa, 1, 16, 40)])
    # The window: the request's last two pages. The index lists go as lists, numpy arrays or
    # tuples, per family.
    run_request(pair, 51, 20, prefix, [[4], (9, 2)], [np.array([0], np.int32), [11, 7]])
    run_request(pair, 52, 20, prefix, [[0], [3, 5]], [[3], (0, 15)], chunks=1)
    run_request(pair, 53, 20, prefix, [[5], [6, 8]], [[0], [12, 13]], chunks=1, layerwise=True)
    # A family may take no part in a request: None or [] on both sides, nothing is written.
    run_request(pair, 54, 20, prefix, [[2], None], [[4], []], chunks=1)


@needs_ucx
def test_two_state_families_refuse_flat_or_mismatched_lists(inproc):
    pair = inproc([(pdlib.StateType.Mamba, 1, 4, 32), (pdlib.StateType.SwaRing, 1, 8, 32)])
    sender = pair.prefill.create_sender(60)
    r = pair.decode.create_receiver(pair.address, 60)
    with pytest.raises(pdlib.InvalidArgumentError, match="without per-family counts"):
        r.init([1], None, [1, 2])  # a flat list with two families
    with pytest.raises(pdlib.InvalidArgumentError, match="for 3 families"):
        r.init([1], None, [[1], [2], []])
    with pytest.raises(TypeError, match=r"state_indices\[1\]: expected the index list"):
        r.init([1], None, [[1], 2])
    with pytest.raises(TypeError, match=r"state_indices\[0\]\[1\]: expected int"):
        r.init([1], None, [[1, "x"], [2]])
    with pytest.raises(TypeError, match=r"state_indices\[1\]: expected an int32 array"):
        r.init([1], None, [[1], np.array([2], np.int64)])
    with pytest.raises(pdlib.OutOfRangeError, match="state family 1"):
        r.init([1], None, [[1], [8]])  # swa_ring has 8 rows
    r.init([1], None, [[1], [2, 3]])
    wait_for(lambda: sender.poll() >= pdlib.KVPoll.WaitingForInput, 10, "WaitingForInput")
    sender.init(1, None)
    # swa_ring rows are matched by position: prefill's 1 row against decode's 2 is refused,
    # naming the family, its kind and both lengths.
    with pytest.raises(pdlib.InvalidArgumentError, match="state family 1: swa_ring state: 1 "
                       "prefill indices, 2 decode indices: ring rows"):
        sender.send([0], True, [[0], [4]])
    sender.abort("test over")
    assert wait_terminal([sender, r]) == [pdlib.KVPoll.Failed] * 2
