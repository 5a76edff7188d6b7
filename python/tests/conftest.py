"""Fixtures and helpers of the pdlib Python tests.

The package under test is found through PYTHONPATH (ctest sets it to the build's python/
folder, see python/CMakeLists.txt). Two-process tests start tests/peer.py as the prefill
process and run decode in the test process itself, checking every byte it received.
Everything listens on 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pdlib  # noqa: E402
from kvpattern import (  # noqa: E402
    STATE_BUFFER_BASE,
    Layout,
    aux_token,
    full_page,
    pick_pages,
    shape_of,
)

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_UCX = "ucx" in pdlib.list_backends()
needs_ucx = pytest.mark.skipif(not HAVE_UCX, reason="pdlib built without the ucx backend")

# UCX transports the two-process tests run over (docs/backends.md "Backends": ucx.tls, ucx.net_devices).
UCX_SHM = {"ucx.tls": "shm"}
UCX_TCP = {"ucx.tls": "tcp", "ucx.net_devices": "lo"}


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def wait_terminal(handles: List[Any], timeout: float = 15.0) -> List[pdlib.KVPoll]:
    wait_for(lambda: all(h.poll().is_terminal for h in handles), timeout, "terminal states")
    return [h.poll() for h in handles]


def fake_options(mode: pdlib.Mode, port: int, pages: int = 64, item: int = 128, layers: int = 2,
                 control_plane: pdlib.ControlPlane = pdlib.ControlPlane.InProcess,
                 slots: int = 16) -> Tuple[pdlib.KVManagerOptions, Dict[str, Any]]:
    """Options of a small manager over the fake backend; the second value holds its buffers."""
    o = pdlib.KVManagerOptions(mode=mode, backend="fake", control_plane=control_plane)
    kv = [np.zeros((pages, item), np.uint8) for _ in range(2 * layers)]
    for buf in kv:
        o.args.kv.add(buf)
    aux = pdlib.MetadataBuffers(slots)
    o.args.aux = aux.describe()
    o.args.page_size = 4
    o.args.fingerprint = pdlib.ModelFingerprint(layers, 4, item // 16, 1, 1, "fake-model")
    o.bootstrap_port = port
    o.start_bootstrap_server = mode == pdlib.Mode.Prefill
    o.liveness_timeout = 1.0
    o.connect_timeout = 2.0
    return o, {"kv": kv, "aux": aux}


@pytest.fixture
def fake_pair():
    """A prefill and a decode manager of one process (in-process control plane, fake backend)."""
    port = free_port()
    po, pbufs = fake_options(pdlib.Mode.Prefill, port)
    do, dbufs = fake_options(pdlib.Mode.Decode, port)
    prefill = pdlib.KVManager.create(po)
    decode = pdlib.KVManager.create(do)
    yield prefill, decode, f"127.0.0.1:{port}", pbufs, dbufs
    decode.close()
    prefill.close()


class Peer:
    """A peer.py child process and its output lines; killed at the end of the test."""

    def __init__(self, cfg: Dict[str, Any]):
        env = dict(os.environ)
        env.setdefault("PDLIB_LOG_LEVEL", "error")
        self.lines: List[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peer.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self._fd = self.proc.stdout.fileno()
        self._partial = ""
        self._seen = 0  # lines already matched against by expect()
        self._eof = False

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The first output line starting with `prefix`, reading for at most `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines[self._seen:]:
                self._seen += 1
                if line.startswith(prefix):
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or self._eof:
                break
            # Raw reads: a buffered reader would hide lines it already holds from select().
            ready, _, _ = select.select([self._fd], [], [], min(left, 0.1))
            if not ready:
                continue
            data = os.read(self._fd, 65536)
            if not data:
                self._eof = True
                continue
            self._partial += data.decode()
            *complete, self._partial = self._partial.split("\n")
            self.lines.extend(complete)
        raise AssertionError(f"peer: no '{prefix}' line; output so far:\n" + "\n".join(self.lines))

    def rooms(self) -> Dict[int, str]:
        out = {}
        for line in self.lines:
            if line.startswith("ROOM "):
                parts = line.split(" ", 4)
                out[int(parts[1])] = parts[3]
        return out

    def quit(self, timeout: float = 20.0) -> int:
        try:
            self.proc.stdin.write("QUIT\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def peers():
    started: List[Peer] = []

    def start(cfg: Dict[str, Any]) -> Peer:
        peer = Peer(cfg)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.kill()


class Decode:
    """A decode rank (TP 1) in the test process that receives rooms and checks every byte."""

    def __init__(self, layout: Layout, bootstrap_port: int, backend: str = "fake",
                 backend_options: Optional[Dict[str, str]] = None, buffers: str = "numpy",
                 seed: int = 1, concurrency: int = 8, prefill_tp: int = 1):
        self.layout = layout
        self.seed = seed
        self.backend = backend
        self.keep: List[Any] = []
        page_bytes = layout.page_bytes(1)
        self.kv = [self._buffer(buffers, layout.pool_pages, page_bytes)
                   for _ in range(layout.kv_buffers)]
        self.state = [self._buffer(buffers, layout.state_slots, layout.state_item_bytes)
                      for _ in range(layout.state_buffers)]
        self.aux = pdlib.MetadataBuffers(2 * concurrency + 2)
        self.slots = pdlib.MetadataSlotAllocator(self.aux.num_slots)
        o = pdlib.KVManagerOptions(mode=pdlib.Mode.Decode, backend=backend,
                                   backend_options=dict(backend_options or {}))
        for owner in self.keep[:len(self.kv)]:
            o.args.kv.add(owner, item_len=page_bytes)
        for owner in self.keep[len(self.kv):]:
            o.args.state.add(owner, item_len=layout.state_item_bytes)
        if self.state:
            o.args.state_type = pdlib.StateType.Mamba
        o.args.aux = self.aux.describe()
        o.args.page_size = layout.page_size
        o.args.kv_head_num = 1 if layout.mla else layout.heads
        o.args.kv_layout = pdlib.KVLayout.HND
        o.args.is_mla = layout.mla
        o.args.fingerprint = pdlib.ModelFingerprint(layout.layers, 1 if layout.mla else
                                                    layout.heads, layout.head_bytes, 1, 1,
                                                    "pdlib-python-test")
        o.liveness_timeout = 1.0
        o.connect_timeout = 3.0
        self.manager = pdlib.KVManager.create(o)
        self.address = f"127.0.0.1:{bootstrap_port}"
        self.concurrency = concurrency

    def _buffer(self, kind: str, rows: int, row_bytes: int) -> np.ndarray:
        if kind == "torch":
            import torch

            tensor = torch.zeros((rows, row_bytes), dtype=torch.uint8)
            self.keep.append(tensor)
            return tensor.numpy()
        array = np.zeros((rows, row_bytes), np.uint8)
        self.keep.append(array)
        return array

    def run(self, rooms: List[int], max_pages: int, max_chunks: int = 1, timeout: float = 60.0,
            verify: bool = True) -> Dict[int, Tuple[pdlib.KVPoll, str]]:
        """Receives `rooms` (at most `concurrency` at once); returns room -> (state, reason)."""
        layout = self.layout
        free = list(range(layout.pool_pages))
        free_state = list(range(layout.state_slots))
        pending = list(rooms)
        live: Dict[int, Dict[str, Any]] = {}
        results: Dict[int, Tuple[pdlib.KVPoll, str]] = {}
        deadline = time.monotonic() + timeout
        while pending or live:
            if time.monotonic() > deadline:
                raise AssertionError(f"rooms not terminal after {timeout} s: {sorted(live)}")
            while pending and len(live) < self.concurrency:
                room = pending.pop(0)
                shape = shape_of(self.seed, room, max_pages, max_chunks)
                rng = random.Random(self.seed * 104729 + room)
                pages = pick_pages(rng, free, shape.pages)
                state_slots = pick_pages(rng, free_state, 1) if self.state else []
                slot = self.slots.alloc()
                receiver = self.manager.create_receiver(self.address, room)
                receiver.init(np.asarray(pages, np.int32), slot,
                              np.asarray(state_slots, np.int32) if state_slots else None)
                live[room] = dict(receiver=receiver, pages=pages, state_slots=state_slots,
                                  slot=slot)
            for room in list(live):
                entry = live[room]
                state = entry["receiver"].poll()
                if not state.is_terminal:
                    continue
                reason = entry["receiver"].failure_reason()
                if state == pdlib.KVPoll.Success and verify and self.backend != "fake":
                    self.verify(room, entry)
                if not entry["receiver"].pages_reusable():
                    continue  # quarantined: keep the pages out of the free list
                results[room] = (state, str(reason) if reason else "OK")
                free.extend(entry["pages"])
                free_state.extend(entry["state_slots"])
                self.slots.free(entry["slot"])
                entry["receiver"].close()
                del live[room]
            time.sleep(0.0005)
        return results

    def verify(self, room: int, entry: Dict[str, Any]) -> None:
        layout = self.layout
        full = layout.page_bytes(1)
        for b, pool in enumerate(self.kv):
            for pos, page in enumerate(entry["pages"]):
                expected = full_page(self.seed, room, b, pos, full)
                if not np.array_equal(pool[page], expected):
                    bad = int(np.argmax(pool[page] != expected))
                    raise AssertionError(f"room {room}: buffer {b} page_pos {pos} (page {page})"
                                         f" differs at byte {bad}")
        for s, pool in enumerate(self.state):
            expected = full_page(self.seed, room, STATE_BUFFER_BASE + s, 0,
                                 layout.state_item_bytes)
            assert np.array_equal(pool[entry["state_slots"][0]], expected), \
                f"room {room}: state buffer {s} differs"
        assert int(self.aux.output_ids[entry["slot"], 0]) == aux_token(room), \
            f"room {room}: aux output_ids[0] differs"
        assert int(self.aux.bootstrap_room[entry["slot"], 0]) == room

    def close(self) -> None:
        self.manager.close()
