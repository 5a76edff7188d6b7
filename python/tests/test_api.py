"""Every call of the binding and its error paths, in one process (fake backend, in-process
control plane unless a test says otherwise)."""

from __future__ import annotations

import gc
import shutil
import socket
import subprocess

import numpy as np
import pytest

import pdlib
from conftest import fake_options, free_port, wait_for, wait_terminal


def test_enums_have_the_cpp_values():
    assert [int(s) for s in pdlib.KVPoll] == [0, 1, 2, 3, 4]
    assert pdlib.KVPoll.Failed == 0 and pdlib.KVPoll.Success == 4
    assert pdlib.KVPoll.Success.is_terminal and not pdlib.KVPoll.Transferring.is_terminal
    assert pdlib.StatusCode.Unauthenticated == 16
    assert (pdlib.Mode.Prefill, pdlib.Mode.Decode) == (0, 1)
    assert pdlib.KVLayout.HND == 1 and pdlib.MemoryKind.Cuda == 1
    assert pdlib.MetadataField.BootstrapRoom == 9


def test_state_types_have_the_cpp_values_and_names():
    names = ["none", "mamba", "swa", "nsa", "minimax_index_k", "swa_ring", "c128_state"]
    assert [int(t) for t in pdlib.StateType] == list(range(7))
    assert [t.type_name for t in pdlib.StateType] == names
    assert (pdlib.StateType.MinimaxIndexK, pdlib.StateType.SwaRing,
            pdlib.StateType.C128State) == (4, 5, 6)
    for t in pdlib.StateType:
        assert pdlib.StateType.from_name(t.type_name) is t
        assert pdlib.StateType(int(t)) is t
    assert pdlib.StateType.from_name("dsa") is pdlib.StateType.Nsa  # SGLang's newer name
    with pytest.raises(ValueError, match="unknown state type 'rwkv'"):
        pdlib.StateType.from_name("rwkv")
    assert pdlib.__version__ == "0.2.0"


def test_state_family_dataclass_round_trips():
    import dataclasses

    buf = np.zeros((4, 32), np.uint8)
    fam = pdlib.StateFamily(pdlib.StateType.SwaRing, pdlib.BufferFamily().add(buf), [0], [1],
                            [8], 2)
    assert (fam.type, fam.dim_per_tensor, fam.item_rows, fam.split_units, fam.start) == \
        (pdlib.StateType.SwaRing, [0], [1], [8], 2)
    assert fam.buffers.ptrs == [buf.ctypes.data] and fam.buffers.item_lens == [32]
    assert [f.name for f in dataclasses.fields(pdlib.StateFamily)] == \
        ["type", "buffers", "dim_per_tensor", "item_rows", "split_units", "start"]
    assert dataclasses.replace(fam) == fam and pdlib.StateFamily(**vars(fam)) == fam
    assert pdlib.StateFamily() == pdlib.StateFamily(pdlib.StateType.Null)
    assert pdlib.StateFamily().dim_per_tensor is not pdlib.StateFamily().dim_per_tensor
    args = pdlib.KVArgs()
    assert args.state_families == [] and args.state_type == pdlib.StateType.Null
    args.state_families.append(fam)
    assert pdlib.KVArgs(state_families=[fam]) == args


def _families_options(families, mode=pdlib.Mode.Prefill):
    o, bufs = fake_options(mode, free_port())
    for kind in families:
        state = np.zeros((8, 64), np.uint8)
        bufs.setdefault("state", []).append(state)
        o.args.state_families.append(
            pdlib.StateFamily(kind, pdlib.BufferFamily().add(state)))
    return o, bufs


def test_state_families_reach_the_cpp_options():
    # Every kind reaches C++ as itself: its name comes back in C++'s messages.
    kinds = [t for t in pdlib.StateType if t != pdlib.StateType.Null]
    o, _ = _families_options(kinds)
    pdlib.KVManager.create(o).close()
    for f, kind in enumerate(kinds):
        o, _ = _families_options(kinds)
        o.args.state_families[f].dim_per_tensor = [0, 0, 0]
        with pytest.raises(pdlib.InvalidArgumentError,
                           match=rf"state family {f} \({kind.type_name}\): dim_per_tensor has 3 "
                           "entries for 1 buffers"):
            pdlib.KVManager.create(o)
    o, _ = _families_options([pdlib.StateType.Null])
    with pytest.raises(pdlib.InvalidArgumentError, match="state family 0: type 0 is not a state"):
        pdlib.KVManager.create(o)
    # The one-family shorthand takes the new kinds too; both at once is refused by C++.
    o, bufs = fake_options(pdlib.Mode.Prefill, free_port())
    state = np.zeros((8, 64), np.uint8)
    o.args.state.add(state)
    o.args.state_type = pdlib.StateType.C128State
    pdlib.KVManager.create(o).close()
    o.args.state_families.append(pdlib.StateFamily(pdlib.StateType.Mamba,
                                                   pdlib.BufferFamily().add(state)))
    with pytest.raises(pdlib.InvalidArgumentError, match="state given twice"):
        pdlib.KVManager.create(o)


def test_state_families_bad_fields_are_named():
    o, _ = _families_options([pdlib.StateType.Mamba, pdlib.StateType.Swa])
    o.args.state_families[1].type = 7
    with pytest.raises(pdlib.OutOfRangeError,
                       match=r"options.args.state_families\[1\].type: 7 is out of range \[0, 6\]"):
        pdlib.KVManager.create(o)
    o, _ = _families_options([pdlib.StateType.Mamba])
    o.args.state_type = 7
    with pytest.raises(pdlib.OutOfRangeError, match=r"options.args.state_type: 7"):
        pdlib.KVManager.create(o)
    o, _ = _families_options([pdlib.StateType.Mamba])
    o.args.state_families[0].buffers.lens.pop()
    with pytest.raises(pdlib.InvalidArgumentError,
                       match=r"options.args.state_families\[0\].buffers"):
        pdlib.KVManager.create(o)
    o, _ = _families_options([pdlib.StateType.Mamba])
    o.args.state_families[0].start = "0"
    with pytest.raises(TypeError, match=r"options.args.state_families\[0\].start"):
        pdlib.KVManager.create(o)
    o, _ = _families_options([pdlib.StateType.Mamba])
    o.args.state_families = [object()]
    with pytest.raises(TypeError, match=r"options.args.state_families\[0\]: has no field"):
        pdlib.KVManager.create(o)
    o, _ = _families_options([])
    o.args.state_families = pdlib.StateFamily()
    with pytest.raises(TypeError, match="options.args.state_families: expected a list"):
        pdlib.KVManager.create(o)


def test_state_families_over_the_fake_backend():
    # Several families end to end in one process (the fake backend moves no bytes: protocol and
    # checks only; test_transfer.py checks bytes over UCX).
    port = free_port()
    kinds = [pdlib.StateType.Mamba, pdlib.StateType.Nsa]
    po, pbufs = _families_options(kinds, pdlib.Mode.Prefill)
    do, dbufs = _families_options(kinds, pdlib.Mode.Decode)
    po.bootstrap_port = do.bootstrap_port = port
    with pdlib.KVManager.create(po) as prefill, pdlib.KVManager.create(do) as decode:
        sender = prefill.create_sender(9)
        receiver = decode.create_receiver(f"127.0.0.1:{port}", 9)
        # nsa: one index per page of the request (2 pages after a 1-page prefix: 3 in all).
        receiver.init([1, 2], 0, [[3], np.array([5, 6, 7], np.int32)], decode_prefix_len=4,
                      prompt_len=12)
        wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
        assert sender.decode_prefix_len == 4 and sender.pages_after_prefix(12) == 2
        pbufs["aux"].bootstrap_room[0, 0] = 9
        sender.init(2, 0)
        sender.send([4], False)
        try:
            import torch

            nsa: object = torch.tensor([0, 1, 2], dtype=torch.int32)  # a tensor per family too
        except ImportError:
            nsa = [0, 1, 2]
        sender.send_layers([5], sender.num_layers, True, ([1], nsa))
        assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2, \
            (sender.failure_reason(), receiver.failure_reason())


def test_all_lists_every_public_name():
    # __all__ is spelled out for type checkers: a public name added without it fails here.
    public = {n for n, v in vars(pdlib).items()
              if not n.startswith("_") and n not in ("annotations", "atexit", "Any", "sglang")
              and not isinstance(v, type(pdlib))}
    assert sorted(pdlib.__all__) == sorted(public)
    assert len(pdlib.__all__) == len(set(pdlib.__all__))


def test_list_backends():
    names = pdlib.list_backends()
    assert "fake" in names and names == sorted(names)
    assert set(pdlib.builtin_backends()) <= set(names)


def test_full_transfer_and_metrics(fake_pair):
    prefill, decode, address, pbufs, dbufs = fake_pair
    assert prefill.mode == pdlib.Mode.Prefill and decode.mode == pdlib.Mode.Decode
    assert isinstance(prefill.endpoint, str) and prefill.endpoint
    sender = prefill.create_sender(7)
    receiver = decode.create_receiver(address, 7)
    assert sender.room == 7 and receiver.room == 7
    assert receiver.poll() in (pdlib.KVPoll.Bootstrapping, pdlib.KVPoll.WaitingForInput)
    receiver.init(np.array([1, 2, 3], np.int32), 0)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    pbufs["aux"].bootstrap_room[0, 0] = 7
    sender.init(3, 0)
    sender.send(np.array([4, 5], np.int32), False)
    sender.send([6], True)
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2
    assert isinstance(receiver.poll(), pdlib.KVPoll)
    assert receiver.failure_reason() is None and sender.failure_reason() is None
    assert receiver.pages_reusable() and sender.pages_reusable()
    m = decode.metrics()
    assert m["rooms_succeeded"] == 1 and m["live_rooms"] == 1
    assert isinstance(m["failed_by_cause"], dict)
    text = pdlib.render_prometheus(m, {"role": "decode"})
    assert 'pdlib_succeeded_reqs_total{role="decode"} 1' in text
    assert decode.take_reusable_rooms() == []


def test_send_layers_streams_a_chunk_layer_by_layer(fake_pair):
    prefill, decode, address, pbufs, dbufs = fake_pair
    sender = prefill.create_sender(8)
    receiver = decode.create_receiver(address, 8)
    receiver.init(np.array([1, 2, 3], np.int32), 0)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    pbufs["aux"].bootstrap_room[0, 0] = 8
    sender.init(3, 0)
    assert sender.num_layers == 2
    pages = np.array([4, 5, 6], np.int32)
    sender.send_layers(pages, 1, True)  # layer 0 of K and V: 2 buffers x 3 pages x 128 bytes
    wait_for(lambda: prefill.metrics()["bytes_transferred"] == 768, 5, "layer 0 written")
    with pytest.raises(pdlib.InvalidArgumentError, match="announces 0 layers after 1"):
        sender.send_layers(pages, 0, True)
    with pytest.raises(pdlib.OutOfRangeError, match="this rank has 2 KV layers"):
        sender.send_layers(pages, 3, True)
    with pytest.raises(pdlib.InvalidArgumentError, match="differing from the 3 pages"):
        sender.send_layers([4, 5], 2, True)
    assert receiver.poll() != pdlib.KVPoll.Success
    sender.send_layers(pages, 2, True)  # the last layer completes the chunk, like send()
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2
    assert prefill.metrics()["bytes_transferred"] == 1536


def test_fingerprint_element_types_are_compared_by_name():
    port = free_port()
    po, pbufs = fake_options(pdlib.Mode.Prefill, port)
    do, dbufs = fake_options(pdlib.Mode.Decode, port)
    po.args.fingerprint.kv_dtype = "fp8_e4m3"
    do.args.fingerprint.kv_dtype = "fp8_e5m2"  # the same size: only the name tells them apart
    with pdlib.KVManager.create(po) as prefill, pdlib.KVManager.create(do) as decode:
        receiver = decode.create_receiver(f"127.0.0.1:{port}", 3)
        assert wait_terminal([receiver]) == [pdlib.KVPoll.Failed]
        assert "kv_dtype 'fp8_e5m2' vs 'fp8_e4m3'" in str(receiver.failure_reason())
        assert prefill.metrics()["live_rooms"] == 0
    assert "bf16" in pdlib.element_type_names()
    do.args.fingerprint.kv_dtype = "bfloat16"
    with pytest.raises(pdlib.InvalidArgumentError, match="kv_dtype 'bfloat16'"):
        pdlib.KVManager.create(do)


def test_failure_reason_reaches_python_intact(fake_pair):
    prefill, decode, address, _, _ = fake_pair
    sender = prefill.create_sender(11)
    receiver = decode.create_receiver(address, 11)
    receiver.init([1], None)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    sender.abort("the engine ran out of memory: request 11")
    assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Failed] * 2
    err = sender.failure_reason()
    assert isinstance(err, pdlib.AbortedError) and err.code == pdlib.StatusCode.Aborted
    assert str(err) == "ABORTED: the engine ran out of memory: request 11" or \
        "the engine ran out of memory: request 11" in err.reason
    remote = receiver.failure_reason()
    assert isinstance(remote, pdlib.Error)
    assert "the engine ran out of memory: request 11" in str(remote)
    with pytest.raises(pdlib.Error):
        raise remote


def test_errors_raise_the_subclass_of_their_code(fake_pair):
    prefill, decode, address, _, _ = fake_pair
    sender = prefill.create_sender(3)
    with pytest.raises(pdlib.AlreadyExistsError) as e:
        prefill.create_sender(3)
    assert e.value.code == pdlib.StatusCode.AlreadyExists and "3" in str(e.value)
    with pytest.raises(pdlib.FailedPreconditionError, match="TransferInfo"):
        sender.send([1], True)  # no TransferInfo from decode yet
    with pytest.raises(pdlib.Error):
        decode.create_sender(4)  # decode has no senders
    with pytest.raises(pdlib.Error):
        prefill.create_receiver(address, 4)
    sender.close()


def test_out_of_range_index_fails_with_a_reason(fake_pair):
    prefill, decode, address, _, _ = fake_pair
    receiver = decode.create_receiver(address, 21)
    with pytest.raises(pdlib.Error, match="812"):
        receiver.init([812], 0)  # the pool has 64 pages
    receiver.close()
    sender = prefill.create_sender(22)
    receiver = decode.create_receiver(address, 22)
    receiver.init([1, 2], 0)
    wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    sender.init(2, 0)
    with pytest.raises(pdlib.Error, match="9999"):
        sender.send([9999, 1], True)


def test_bad_index_inputs_are_rejected_before_pdlib(fake_pair):
    _, decode, address, _, _ = fake_pair
    receiver = decode.create_receiver(address, 5)
    with pytest.raises(TypeError, match="int32"):
        receiver.init(np.array([1, 2], np.int64), 0)
    with pytest.raises(TypeError, match="int32"):
        receiver.init(np.array([1.0]), 0)
    with pytest.raises(TypeError, match="contiguous"):
        receiver.init(np.arange(8, dtype=np.int32)[::2], 0)
    with pytest.raises(TypeError, match="1-D"):
        receiver.init(np.zeros((2, 2), np.int32), 0)
    with pytest.raises(TypeError, match=r"kv_page_indices\[1\]"):
        receiver.init([1, "2"], 0)
    with pytest.raises(TypeError):
        receiver.init([1, True], 0)
    with pytest.raises(pdlib.OutOfRangeError, match=r"kv_page_indices\[0\]"):
        receiver.init([1 << 40], 0)
    with pytest.raises(pdlib.OutOfRangeError, match="aux_index"):
        receiver.init([1], -1)
    with pytest.raises(TypeError):
        receiver.init("123", 0)
    with pytest.raises(TypeError):
        decode.create_receiver(address, "7")
    with pytest.raises(pdlib.OutOfRangeError):
        decode.create_receiver(address, -1)
    with pytest.raises(pdlib.InvalidArgumentError):
        decode.create_receiver("no-port-here", 6)
    with pytest.raises(pdlib.InvalidArgumentError):
        decode.create_receiver(("127.0.0.1", 0), 6)
    # None of the above consumed the receiver: it still takes a valid Init.
    receiver.init(np.array([1, 2], np.int32), 0)


def test_numpy_and_torch_indices_without_copy(fake_pair):
    torch = pytest.importorskip("torch")
    _, decode, address, _, _ = fake_pair
    r1 = decode.create_receiver(address, 31)
    r1.init(torch.tensor([1, 2, 3], dtype=torch.int32), 0)
    r2 = decode.create_receiver(address, 32)
    with pytest.raises(TypeError, match="torch.int32"):
        r2.init(torch.tensor([1, 2], dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="contiguous"):
        r2.init(torch.arange(8, dtype=torch.int32)[::2], 0)
    r2.init((4, 5), 1)  # a tuple is fine too


def test_closed_manager_raises_and_handles_keep_their_state(fake_pair):
    prefill, decode, address, pbufs, _ = fake_pair
    done_s = prefill.create_sender(41)
    done_r = decode.create_receiver(address, 41)
    done_r.init([1], 0)
    wait_for(lambda: done_s.poll() == pdlib.KVPoll.WaitingForInput, 5, "WaitingForInput")
    pbufs["aux"].bootstrap_room[0, 0] = 41
    done_s.init(1, 0)
    done_s.send([1], True)
    wait_terminal([done_s, done_r])
    live = decode.create_receiver(address, 42)
    decode.close()
    assert decode.closed and done_r.closed and live.closed
    assert done_r.poll() == pdlib.KVPoll.Success and done_r.pages_reusable()
    assert live.poll() == pdlib.KVPoll.Failed
    assert isinstance(live.failure_reason(), pdlib.CancelledError)
    assert "manager closed" in str(live.failure_reason())
    for call in (lambda: decode.create_receiver(address, 43), decode.metrics,
                 decode.take_reusable_rooms, lambda: decode.endpoint,
                 lambda: live.init([1], 0)):
        with pytest.raises(pdlib.ClosedError, match="closed"):
            call()
    live.abort()  # idempotent, no error on a closed handle
    decode.close()  # idempotent
    assert pdlib.poll_and_all_reduce([done_r, live]) == [pdlib.KVPoll.Success,
                                                         pdlib.KVPoll.Failed]


def test_handles_outliving_their_manager_object_are_safe():
    port = free_port()
    po, _ = fake_options(pdlib.Mode.Prefill, port)
    prefill = pdlib.KVManager.create(po)
    senders = [prefill.create_sender(r) for r in range(4)]
    del prefill, po
    gc.collect()
    assert [s.poll() for s in senders] == [pdlib.KVPoll.Bootstrapping] * 4
    senders[0].abort("bye")
    del senders
    gc.collect()


def test_with_blocks_close():
    port = free_port()
    po, _ = fake_options(pdlib.Mode.Prefill, port)
    with pdlib.KVManager.create(po) as prefill:
        with prefill.create_sender(1) as sender:
            assert not sender.closed
        assert sender.closed and sender.poll() == pdlib.KVPoll.Failed
    assert prefill.closed


def test_create_reports_the_bad_field():
    port = free_port()
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.backend = "no-such-backend"
    with pytest.raises(pdlib.NotFoundError, match="fake"):
        pdlib.KVManager.create(o)  # the message lists the known backends
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.args.page_size = "16"
    with pytest.raises(TypeError, match="options.args.page_size"):
        pdlib.KVManager.create(o)
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.args.kv.lens.pop()
    with pytest.raises(pdlib.InvalidArgumentError, match="options.args.kv"):
        pdlib.KVManager.create(o)
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.liveness_timeout = -1.0
    with pytest.raises(pdlib.OutOfRangeError, match="liveness_timeout"):
        pdlib.KVManager.create(o)
    o, _ = fake_options(pdlib.Mode.Prefill, port)
    o.args.kv.item_lens[0] = 7  # does not divide the buffer into pages as its siblings do
    o.args.kv.lens[0] = 3
    with pytest.raises(pdlib.Error):
        pdlib.KVManager.create(o)


def test_buffer_address_accepts_and_rejects():
    a = np.zeros((4, 16), np.uint8)
    ptr, n, cuda = pdlib.buffer_address(a)
    assert ptr == a.ctypes.data and n == 64 and not cuda
    with pytest.raises(ValueError, match="contiguous"):
        pdlib.buffer_address(np.zeros((4, 16), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="nbytes"):
        pdlib.buffer_address(12345)
    assert pdlib.buffer_address(4096, 10) == (4096, 10, False)
    with pytest.raises(ValueError):
        pdlib.buffer_address(a, 65)
    with pytest.raises(TypeError):
        pdlib.buffer_address(object())
    ptr, n, _ = pdlib.buffer_address(bytearray(32))
    assert n == 32 and ptr != 0
    family = pdlib.BufferFamily().add(a)
    assert family.item_lens == [16] and family.owners == [a]
    with pytest.raises(TypeError, match="item_len"):
        pdlib.BufferFamily().add(np.zeros(16, np.uint8))


def test_torch_buffers():
    torch = pytest.importorskip("torch")
    t = torch.zeros((8, 4), dtype=torch.float16)
    ptr, n, cuda = pdlib.buffer_address(t)
    assert ptr == t.data_ptr() and n == 64 and not cuda
    assert pdlib.BufferFamily().add(t).item_lens == [8]
    with pytest.raises(ValueError, match="contiguous"):
        pdlib.buffer_address(t.t())


def test_metadata_buffers_views():
    mb = pdlib.MetadataBuffers(4, hidden_size=8, hidden_dtype_bytes=2)
    assert mb.num_slots == 4 and pdlib.MetadataBuffers.slot_count_for(3) == 6
    assert mb.output_ids.shape == (4, 16) and mb.output_ids.dtype == np.int32
    assert mb.output_top_logprobs_val.shape == (4, 128)
    assert mb.output_topk_index.dtype == np.int64
    assert mb.bootstrap_room.dtype == np.uint64 and mb.bootstrap_room.shape == (4, 8)
    assert mb.output_hidden_states.shape == (4, 16)
    assert mb.row_bytes(pdlib.MetadataField.OutputIds) % 64 == 0
    assert mb.elements(pdlib.MetadataField.OutputTopLogprobsIdx) == 128
    mb.output_ids[2, 0] = 1234
    family = mb.describe()
    row = mb.row_bytes(pdlib.MetadataField.OutputIds)
    raw = np.frombuffer((np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * (4 * row)).from_address(family.ptrs[0]))), np.int32)
    assert raw[2 * row // 4] == 1234  # the view is the registered memory
    assert len(family) == 10 and family.owners == [mb]
    view = mb.output_ids
    del mb
    gc.collect()
    assert view[2, 0] == 1234  # the view keeps the buffers alive
    with pytest.raises(pdlib.Error):
        pdlib.MetadataBuffers(0)
    with pytest.raises(pdlib.OutOfRangeError):
        pdlib.MetadataBuffers(2).row_bytes(10)


def test_slot_allocator():
    a = pdlib.MetadataSlotAllocator(2)
    assert a.capacity == 2 and a.available == 2
    s0, s1 = a.alloc(), a.alloc()
    assert {s0, s1} == {0, 1} and a.alloc() is None
    a.free(s0)
    with pytest.raises(pdlib.FailedPreconditionError):
        a.free(s0)  # double free
    with pytest.raises(pdlib.OutOfRangeError):
        a.free(5)


def test_kv_pool():
    pool = pdlib.allocate_kv_pool("fake", 1 << 16)
    assert pool.size >= 1 << 16 and pool.kind == pdlib.MemoryKind.Host
    assert pool.allocator == "host" and pool.data_ptr != 0
    view = pool.view()
    view[:4] = [1, 2, 3, 4]
    del pool
    gc.collect()
    assert list(view[:4]) == [1, 2, 3, 4]
    with pytest.raises(pdlib.NotFoundError):
        pdlib.allocate_kv_pool("no-such-backend", 4096)
    with pytest.raises(pdlib.InvalidArgumentError):
        pdlib.allocate_kv_pool("fake", 0)
    with pytest.raises(pdlib.UnimplementedError):
        pdlib.allocate_kv_pool("fake", 4096, pdlib.MemoryKind.Cuda)


def test_bootstrap_server():
    with pdlib.BootstrapServer("127.0.0.1", 0) as server:
        assert server.port > 0 and server.address.endswith(str(server.port))
        assert server.ranks_registered == 0
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass
        taken = server.port
        with pytest.raises(pdlib.UnavailableError):
            pdlib.BootstrapServer("127.0.0.1", taken)
    assert server.closed
    with pytest.raises(pdlib.ClosedError):
        server.port


def test_prefill_registers_with_a_python_bootstrap_server():
    with pdlib.BootstrapServer("127.0.0.1", 0) as server:
        po, _ = fake_options(pdlib.Mode.Prefill, server.port,
                             control_plane=pdlib.ControlPlane.Grpc)
        po.start_bootstrap_server = False
        with pdlib.KVManager.create(po):
            wait_for(lambda: server.ranks_registered == 1, 10, "registration")


def test_bootstrap_port_0_picks_a_free_port_and_reports_it():
    po, _ = fake_options(pdlib.Mode.Prefill, 0, control_plane=pdlib.ControlPlane.Grpc)
    with pdlib.KVManager.create(po) as prefill:
        host, port = prefill.bootstrap_endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        do, _ = fake_options(pdlib.Mode.Decode, int(port), control_plane=pdlib.ControlPlane.Grpc)
        with pdlib.KVManager.create(do) as decode:
            assert decode.bootstrap_endpoint == ""
            receiver = decode.create_receiver(prefill.bootstrap_endpoint, 5)
            wait_for(lambda: receiver.poll() == pdlib.KVPoll.WaitingForInput, 10, "bootstrap")
    po.start_bootstrap_server = False
    with pytest.raises(pdlib.InvalidArgumentError, match="start_bootstrap_server"):
        pdlib.KVManager.create(po)


def test_connect_warms_up_and_fails_with_a_reason(fake_pair):
    prefill, decode, address, _, _ = fake_pair
    assert decode.metrics()["connections"] == 0
    decode.connect(address, timeout=5.0)
    assert decode.metrics()["connections"] == 1
    with pytest.raises(pdlib.UnavailableError, match="connecting to the deployment at"):
        decode.connect(("127.0.0.1", free_port()), timeout=0.2)
    with pytest.raises(pdlib.FailedPreconditionError):
        prefill.connect(address, timeout=0.1)
    with pytest.raises(ValueError):
        decode.connect(address, timeout=-1)


def test_logging_sink_and_level():
    lines = []
    old = pdlib.get_log_level()
    pdlib.set_log_level(pdlib.LogLevel.Info)
    assert pdlib.get_log_level() == pdlib.LogLevel.Info
    pdlib.set_log_sink(lambda level, file, line, msg: lines.append((level, msg)))
    try:
        port = free_port()
        o, _ = fake_options(pdlib.Mode.Decode, port)
        with pdlib.KVManager.create(o) as decode:
            r = decode.create_receiver(f"127.0.0.1:{port}", 1)
            r.abort("logged abort")
            wait_terminal([r])
        wait_for(lambda: any("logged abort" in m for _, m in lines) or lines, 5, "a log line")
        assert all(isinstance(level, pdlib.LogLevel) for level, _ in lines)
    finally:
        pdlib.set_log_sink(None)
        pdlib.set_log_level(old)
    with pytest.raises(TypeError):
        pdlib.set_log_sink(42)


def test_page_index_helpers():
    pages = pdlib.token_indices_to_page_indices(np.arange(16, 28, dtype=np.int32), 4)
    assert list(pages) == [4, 5, 6] and pages.dtype == np.int32
    assert pdlib.page_count(9, 4) == 3
    with pytest.raises(pdlib.Error):
        pdlib.token_indices_to_page_indices([-1], 4)


def test_poll_and_all_reduce_python_group(fake_pair):
    _, decode, address, _, _ = fake_pair
    r1 = decode.create_receiver(address, 51)
    r2 = decode.create_receiver(address, 52)
    calls = []

    def group(values):
        calls.append(values.copy())
        values[:] = np.minimum(values, [pdlib.KVPoll.Failed, pdlib.KVPoll.Success])

    states = pdlib.poll_and_all_reduce([r1, r2], group)
    assert states[0] == pdlib.KVPoll.Failed and states[1] != pdlib.KVPoll.Failed
    assert len(calls) == 1 and calls[0].dtype == np.int32

    class Returning:
        size = 2

        def all_reduce_min(self, values):
            return [0, 0]

    assert pdlib.poll_and_all_reduce([r1, r2], Returning()) == [pdlib.KVPoll.Failed] * 2
    assert pdlib.poll_and_all_reduce([r1, r2]) == [r1.poll(), r2.poll()]

    def raising(values):
        raise RuntimeError("collective broke")

    with pytest.raises(RuntimeError, match="collective broke"):
        pdlib.poll_and_all_reduce([r1], raising)
    with pytest.raises(pdlib.InvalidArgumentError):
        pdlib.poll_and_all_reduce([r1, r2], lambda v: [1, 2, 3])
    with pytest.raises(TypeError):
        pdlib.poll_and_all_reduce([r1, "x"])
    with pytest.raises(TypeError):
        pdlib.poll_and_all_reduce([r1], 42)


def test_in_process_group_threads(fake_pair):
    import threading

    _, decode, address, _, _ = fake_pair
    rs = [decode.create_receiver(address, 60 + i) for i in range(2)]
    rs[1].abort("rank 1 gave up")
    members = pdlib.in_process_group(2)
    assert [m.rank for m in members] == [0, 1] and members[0].size == 2
    out = [None, None]

    def rank(i):
        # Rank 0 sees only receiver 0, rank 1 only receiver 1 (failed): both must agree.
        out[i] = pdlib.poll_and_all_reduce([rs[i]], members[i])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0] == out[1] == [pdlib.KVPoll.Failed]
    with pytest.raises(pdlib.InvalidArgumentError):
        pdlib.in_process_group(0)


def test_etcd_discovery_options_are_checked_by_name():
    po, _ = fake_options(pdlib.Mode.Decode, 1, control_plane=pdlib.ControlPlane.Grpc)
    po.discovery = pdlib.Discovery.Etcd
    with pytest.raises(pdlib.InvalidArgumentError, match="etcd_endpoints"):
        pdlib.KVManager.create(po)
    po.etcd_endpoints = ["127.0.0.1"]
    with pytest.raises(pdlib.InvalidArgumentError, match="'127.0.0.1'"):
        pdlib.KVManager.create(po)
    po.etcd_endpoints = [f"127.0.0.1:{free_port()}"]  # nobody there
    po.connect_timeout = 0.5
    with pytest.raises(pdlib.UnavailableError, match=po.etcd_endpoints[0]):
        pdlib.KVManager.create(po)


def test_etcd_discovery_prefill_and_decode_meet_through_a_real_etcd(tmp_path):
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.skip("etcd is not installed (Debian: etcd-server; scripts/install-deps.sh)")
    client, peer = free_port(), free_port()
    curl, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [etcd, "--name", "t", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", curl,
         "--advertise-client-urls", curl, "--listen-peer-urls", purl,
         "--initial-advertise-peer-urls", purl, "--initial-cluster", f"t={purl}",
         "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deployment = free_port()  # names the deployment; no server runs there
        options = []
        for mode in (pdlib.Mode.Prefill, pdlib.Mode.Decode):
            o, bufs = fake_options(mode, deployment, control_plane=pdlib.ControlPlane.Grpc)
            o.start_bootstrap_server = False
            o.discovery = pdlib.Discovery.Etcd
            o.etcd_endpoints = [f"127.0.0.1:{client}"]
            o.etcd_prefix = "/pytest"
            o.connect_timeout = 10.0  # etcd may still be starting
            options.append((o, bufs))
        with pdlib.KVManager.create(options[0][0]) as prefill, \
                pdlib.KVManager.create(options[1][0]) as decode:
            sender = prefill.create_sender(7)
            receiver = decode.create_receiver(f"127.0.0.1:{deployment}", 7)
            receiver.init(np.array([1, 2], np.int32), 0)
            wait_for(lambda: sender.poll() == pdlib.KVPoll.WaitingForInput, 10, "bootstrap")
            sender.init(2, 0)
            sender.send(np.array([3, 4], np.int32), True)
            assert wait_terminal([sender, receiver]) == [pdlib.KVPoll.Success] * 2
    finally:
        proc.kill()
        proc.wait()
