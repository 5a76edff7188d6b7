"""Decode pull (issue #29) through the Python API: TransferDirection, KVManagerOptions.direction
and pull_lease, KVReceiver.invalid_pages(). Both managers run in this process over the fake
backend (its reads are validated like writes, it moves no bytes), with the in-process and the
gRPC control plane; test/pull_test.cc covers the same protocol from C++."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Tuple

import numpy as np
import pytest

import pdlib
from conftest import fake_options, free_port, wait_for, wait_terminal

PLANES = [pdlib.ControlPlane.InProcess, pdlib.ControlPlane.Grpc]
PLANE_IDS = ["in_process", "grpc"]
# fake_options: 2 layers of K and V (4 buffers), 128-byte pages.
PAGE_BYTES_ALL_BUFFERS = 4 * 128

Pair = Tuple[pdlib.KVManager, pdlib.KVManager, str, Dict[str, Any], Dict[str, Any]]


def start_pair(plane: pdlib.ControlPlane,
               prefill_direction: pdlib.TransferDirection = pdlib.TransferDirection.Pull,
               decode_direction: pdlib.TransferDirection = pdlib.TransferDirection.Pull,
               pull_lease: float = 30.0) -> Pair:
    port = free_port()
    po, pbufs = fake_options(pdlib.Mode.Prefill, port, control_plane=plane)
    do, dbufs = fake_options(pdlib.Mode.Decode, port, control_plane=plane)
    po.direction, po.pull_lease = prefill_direction, pull_lease
    do.direction = decode_direction
    prefill = pdlib.KVManager.create(po)
    decode = pdlib.KVManager.create(do)
    return prefill, decode, f"127.0.0.1:{port}", pbufs, dbufs


def aux_row_bytes(bufs: Dict[str, Any]) -> int:
    return sum(bufs["aux"].row_bytes(f) for f in pdlib.MetadataField)


@pytest.fixture(params=PLANES, ids=PLANE_IDS)
def pull_pair(request: Any) -> Iterator[Pair]:
    pair = start_pair(request.param)
    yield pair
    pair[1].close()
    pair[0].close()


def test_direction_enum_and_options_defaults():
    assert (pdlib.TransferDirection.Push, pdlib.TransferDirection.Pull) == (0, 1)
    assert [d.direction_name for d in pdlib.TransferDirection] == ["push", "pull"]
    o = pdlib.KVManagerOptions()
    assert o.direction is pdlib.TransferDirection.Push and o.pull_lease == 30.0
    names = [f.name for f in dataclasses.fields(pdlib.KVManagerOptions)]
    # Added options come after the older ones: positional options keep their meaning.
    assert names[-4:] == ["direction", "pull_lease", "checksum", "checksum_sample_every"]


def test_bad_direction_and_lease_are_refused_naming_the_field():
    port = free_port()
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.direction = 2  # type: ignore[assignment]
    with pytest.raises(pdlib.OutOfRangeError, match=r"options\.direction"):
        pdlib.KVManager.create(o)
    o.direction = pdlib.TransferDirection.Pull
    o.pull_lease = -1.0
    with pytest.raises(pdlib.OutOfRangeError, match=r"options\.pull_lease"):
        pdlib.KVManager.create(o)
    o.pull_lease = 0.5  # pdlib's own floor: 1000 ms
    with pytest.raises(pdlib.InvalidArgumentError, match="pull_lease 500 ms must be >= 1000 ms"):
        pdlib.KVManager.create(o)
    o.pull_lease = 1.0
    pdlib.KVManager.create(o).close()


def test_pull_prefill_publishes_before_decode_comes(pull_pair):
    prefill, decode, address, pbufs, _ = pull_pair
    sender = prefill.create_sender(5)
    pbufs["aux"].bootstrap_room[1, 0] = 5
    # Pull: init() and send() need no TransferInfo; the pages are published and held.
    sender.init(3, 1)
    sender.send(np.array([4, 9], np.int32), False)
    sender.send([2], True)
    assert sender.poll() == pdlib.KVPoll.Transferring
    assert not sender.pages_reusable()
    receiver = decode.create_receiver(address, 5)
    receiver.init(np.array([30, 29, 28], np.int32), 2)
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2, \
        (sender.failure_reason(), receiver.failure_reason())
    assert sender.pages_reusable() and receiver.pages_reusable()
    assert receiver.invalid_pages() == []
    # Decode counts the bytes it read (the KV pages and the aux row); prefill moved nothing.
    assert decode.metrics()["bytes_transferred"] == \
        3 * PAGE_BYTES_ALL_BUFFERS + aux_row_bytes(pbufs)
    assert prefill.metrics()["bytes_transferred"] == 0
    assert prefill.metrics()["rooms_succeeded"] == 1


def test_pull_decode_first_with_a_prefix_reads_only_the_pages_after_it(pull_pair):
    prefill, decode, address, pbufs, _ = pull_pair
    sender = prefill.create_sender(6)
    receiver = decode.create_receiver(address, 6)
    # The prompt's pages 1 and 2 (12 tokens of 4-token pages); decode holds page 0.
    receiver.init([20, 21], 3, decode_prefix_len=4, prompt_len=12)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    assert sender.decode_prefix_len == 4
    # In pull prefill publishes the whole prompt: every page, whatever decode's prefix.
    assert sender.pages_after_prefix(12) == 3
    pbufs["aux"].bootstrap_room[3, 0] = 6
    sender.init(3, 3)
    with pytest.raises(pdlib.OutOfRangeError):
        sender.send([1, 2, 3, 4], True)  # more than the prompt's pages; changes nothing
    sender.send([1, 2, 3], True)
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2, \
        (sender.failure_reason(), receiver.failure_reason())
    # Only the two pages after the prefix were read (and the aux row).
    assert decode.metrics()["bytes_transferred"] == \
        2 * PAGE_BYTES_ALL_BUFFERS + aux_row_bytes(pbufs)


@pytest.mark.parametrize("plane", PLANES, ids=PLANE_IDS)
def test_pull_lease_expiry_fails_the_room_with_the_reason(plane):
    prefill, decode, address, _, _ = start_pair(plane, pull_lease=1.0)
    try:
        sender = prefill.create_sender(7)
        sender.send([1, 2], True)
        assert not sender.pages_reusable()
        assert wait_terminal([sender], 5.0) == [pdlib.KVPoll.Failed]
        err = sender.failure_reason()
        assert isinstance(err, pdlib.DeadlineExceededError)
        assert "pull lease of 1000 ms expired (no decode rank came to read the pages)" in str(err)
        wait_for(sender.pages_reusable, 2.0, "the published pages freed")
        # A decode that comes too late fails with prefill's reason.
        receiver = decode.create_receiver(address, 7)
        receiver.init([3, 4], None)
        assert wait_terminal([receiver]) == [pdlib.KVPoll.Failed]
        assert "pull lease" in str(receiver.failure_reason())
        wait_for(receiver.pages_reusable, 5.0, "decode's pages reusable")
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("plane", PLANES, ids=PLANE_IDS)
@pytest.mark.parametrize("prefill_dir, decode_dir", [
    (pdlib.TransferDirection.Pull, pdlib.TransferDirection.Push),
    (pdlib.TransferDirection.Push, pdlib.TransferDirection.Pull),
], ids=["prefill_pull", "prefill_push"])
def test_direction_mismatch_is_refused_naming_both(plane, prefill_dir, decode_dir):
    prefill, decode, address, _, _ = start_pair(plane, prefill_dir, decode_dir)
    try:
        # Refused when decode registers with prefill, before any init().
        receiver = decode.create_receiver(address, 10)
        assert wait_terminal([receiver]) == [pdlib.KVPoll.Failed]
        err = receiver.failure_reason()
        assert isinstance(err, pdlib.FailedPreconditionError), err
        assert (f"direction mismatch: decode uses {decode_dir.direction_name}, prefill uses "
                f"{prefill_dir.direction_name}") in str(err)
    finally:
        decode.close()
        prefill.close()


def test_pull_invalid_pages_after_a_partial_failure(pull_pair):
    prefill, decode, address, _, _ = pull_pair
    sender = prefill.create_sender(12)
    receiver = decode.create_receiver(address, 12)
    dst = [10, 11, 12, 13]
    receiver.init(np.array(dst, np.int32), None)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    assert receiver.invalid_pages() == []  # live: nothing to report
    sender.send([1, 2], False)
    # Decode has read the first chunk (a read is counted once it completed).
    wait_for(lambda: decode.metrics()["bytes_transferred"] >= 2 * PAGE_BYTES_ALL_BUFFERS, 5,
             "the first chunk read")
    sender.abort("the engine gave up")
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Failed] * 2
    assert "the engine gave up" in str(receiver.failure_reason())
    assert receiver.invalid_pages() == [12, 13]  # 10 and 11 hold their KV: keep them
    wait_for(lambda: receiver.pages_reusable() and sender.pages_reusable(), 5, "pages reusable")
    assert receiver.invalid_pages() == [12, 13]  # still answered once the pages are free
    receiver.close()
    with pytest.raises(pdlib.ClosedError):
        receiver.invalid_pages()


def test_push_invalid_pages_is_every_page(fake_pair):
    prefill, decode, address, _, _ = fake_pair
    sender = prefill.create_sender(14)
    receiver = decode.create_receiver(address, 14)
    receiver.init([10, 11], None)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    assert receiver.invalid_pages() == []
    sender.abort("gave up")
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Failed] * 2
    assert receiver.invalid_pages() == [10, 11]  # decode cannot tell which writes landed
