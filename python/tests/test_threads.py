"""Many Python threads polling, sending and closing at once: nothing may crash, hang or lose a
request (the binding releases the GIL in every call that works and keeps it in poll())."""

from __future__ import annotations

import threading
import time

import numpy as np

import pdlib
from conftest import fake_options, free_port, wait_for


def run_threads(targets, timeout=60.0):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_many_threads_transfer_at_once(fake_pair):
    prefill, decode, address, pbufs, _ = fake_pair
    threads, per_thread = 8, 25
    pbufs["aux"].bootstrap_room[:, 0] = 0

    def worker(t):
        def run():
            for i in range(per_thread):
                room = 1000 + t * per_thread + i
                sender = prefill.create_sender(room)
                receiver = decode.create_receiver(address, room)
                pages = np.array([t * 8 + i % 8, (t * 8 + i + 1) % 64], np.int32)
                receiver.init(pages, None)
                wait_for(lambda: sender.poll() >= pdlib.KVPoll.WaitingForInput, 10, "wait")
                sender.init(2, None)
                sender.send(pages, True)
                wait_for(lambda: receiver.poll().is_terminal, 10, "terminal")
                assert receiver.poll() == pdlib.KVPoll.Success, receiver.failure_reason()
                sender.close()
                receiver.close()
        return run

    stop = threading.Event()

    def poller():
        # Polls and reads metrics in a tight loop while the workers run.
        while not stop.is_set():
            decode.metrics()
            prefill.take_reusable_rooms()

    poll_thread = threading.Thread(target=poller)
    poll_thread.start()
    try:
        run_threads([worker(t) for t in range(threads)])
    finally:
        stop.set()
        poll_thread.join(10)
    assert decode.metrics()["rooms_succeeded"] == threads * per_thread


def test_close_while_threads_are_inside_calls():
    for _ in range(5):
        port = free_port()
        po, _ = fake_options(pdlib.Mode.Prefill, port)
        do, _ = fake_options(pdlib.Mode.Decode, port)
        prefill = pdlib.KVManager.create(po)
        decode = pdlib.KVManager.create(do)
        address = f"127.0.0.1:{port}"
        receivers = [decode.create_receiver(address, r) for r in range(32)]
        go = threading.Event()

        def hammer(offset):
            def run():
                go.wait()
                for i in range(2000):
                    r = receivers[(i + offset) % len(receivers)]
                    r.poll()
                    try:
                        r.init([1], None)
                    except pdlib.Error:
                        pass  # already initialised, or closed: both are fine here
                    r.failure_reason()
                    r.pages_reusable()
                    try:
                        decode.create_receiver(address, 10000 + offset * 10000 + i)
                    except pdlib.ClosedError:
                        return
            return run

        def closer():
            go.wait()
            time.sleep(0.01)
            decode.close()

        go.set()
        run_threads([hammer(k) for k in range(4)] + [closer])
        assert all(r.poll() in (pdlib.KVPoll.Failed, pdlib.KVPoll.Success) for r in receivers)
        prefill.close()


def test_poll_from_many_threads_is_consistent(fake_pair):
    _, decode, address, _, _ = fake_pair
    receivers = [decode.create_receiver(address, 500 + i) for i in range(16)]
    seen = []

    def poll_loop():
        local = set()
        for _ in range(5000):
            for r in receivers:
                local.add(r.poll())
        seen.append(local)

    def aborter():
        for r in receivers:
            r.abort("stop")

    run_threads([poll_loop for _ in range(4)] + [aborter])
    for states in seen:
        assert states <= set(pdlib.KVPoll)
    assert all(r.poll() == pdlib.KVPoll.Failed for r in receivers)
