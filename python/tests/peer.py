"""A prefill process for the two-process tests: python3 peer.py '<json config>'.

Builds one pdlib prefill manager per TP rank (threads of this process share one loop), prints
"READY port=<bootstrap port>", then serves the configured rooms the way an engine's scheduler
would: a sender per room per rank, and once a sender reaches WaitingForInput its source pages
are filled with the test pattern and sent in the room's chunks. Each terminal room prints
"ROOM <room> <rank> <state> <reason>"; "DONE ok=<n> failed=<m>" follows the last one. The
process then waits for "QUIT" (or EOF) on stdin, closes its managers and prints "BYE".

Config keys: api ("core" or "sglang"), backend, backend_options, bootstrap_port,
start_bootstrap, tp_size, layout (kvpattern.Layout fields), rooms, seed, max_pages,
max_chunks, concurrency, buffers ("numpy", "torch" or "pool"), hold (never send: for kill
tests), liveness_timeout, max_seconds (a watchdog: exit 3 after this long).
"""

from __future__ import annotations

import json
import os
import random
import select
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import pdlib  # noqa: E402
from kvpattern import (  # noqa: E402
    STATE_BUFFER_BASE,
    Layout,
    aux_token,
    full_page,
    pick_pages,
    rank_slice,
    shape_of,
)


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_pool(kind: str, rows: int, row_bytes: int, backend: str, backend_options: Dict[str, str],
              keep: List[Any]) -> np.ndarray:
    """A [rows, row_bytes] uint8 buffer of the requested kind, as a numpy view for filling."""
    if kind == "torch":
        import torch

        tensor = torch.zeros((rows, row_bytes), dtype=torch.uint8)
        keep.append(tensor)
        return tensor.numpy()
    if kind == "pool":
        pool = pdlib.allocate_kv_pool(backend, rows * row_bytes, pdlib.MemoryKind.Host,
                                      backend_options)
        keep.append(pool)
        return pool.view()[: rows * row_bytes].reshape(rows, row_bytes)
    array = np.zeros((rows, row_bytes), dtype=np.uint8)
    keep.append(array)
    return array


class Rank:
    """One prefill TP rank: its manager, pools and live senders."""

    def __init__(self, cfg: Dict[str, Any], layout: Layout, tp_rank: int):
        self.cfg = cfg
        self.layout = layout
        self.tp_size = cfg.get("tp_size", 1)
        self.tp_rank = tp_rank
        backend = cfg.get("backend", "fake")
        backend_options = cfg.get("backend_options", {})
        self.keep: List[Any] = []
        page_bytes = layout.page_bytes(self.tp_size)
        kind = cfg.get("buffers", "numpy")
        self.kv = [make_pool(kind, layout.pool_pages, page_bytes, backend, backend_options,
                             self.keep) for _ in range(layout.kv_buffers)]
        self.state = [make_pool(kind, layout.state_slots, layout.state_item_bytes, backend,
                                backend_options, self.keep)
                      for _ in range(layout.state_buffers)]
        self.aux = pdlib.MetadataBuffers(2 * cfg.get("concurrency", 8) + 2)
        self.slots = pdlib.MetadataSlotAllocator(self.aux.num_slots)
        o = pdlib.KVManagerOptions(mode=pdlib.Mode.Prefill, backend=backend,
                                   backend_options=dict(backend_options))
        for i, buf in enumerate(self.kv):
            # self.keep holds the owning objects; numpy views are what add() sees.
            o.args.kv.add(self.keep[i] if kind == "torch" else buf, item_len=page_bytes)
        for s, buf in enumerate(self.state):
            o.args.state.add(self.keep[len(self.kv) + s] if kind == "torch" else buf,
                             item_len=layout.state_item_bytes)
        if self.state:
            o.args.state_type = pdlib.StateType.Mamba
        o.args.aux = self.aux.describe()
        o.args.page_size = layout.page_size
        o.args.kv_head_num = 1 if layout.mla else layout.heads // self.tp_size
        o.args.kv_layout = pdlib.KVLayout.HND
        o.args.is_mla = layout.mla
        o.args.parallel = pdlib.ParallelConfig(tp_size=self.tp_size, tp_rank=tp_rank)
        o.args.fingerprint = pdlib.ModelFingerprint(layout.layers, 1 if layout.mla else
                                                    layout.heads, layout.head_bytes, 1, 1,
                                                    cfg.get("model_name", "pdlib-python-test"))
        o.bootstrap_port = cfg["bootstrap_port"]
        o.start_bootstrap_server = tp_rank == 0 and cfg.get("start_bootstrap", True)
        o.liveness_timeout = cfg.get("liveness_timeout", 1.0)
        o.transfer_workers = cfg.get("transfer_workers", 2)
        self.manager = pdlib.KVManager.create(o)
        self.free = list(range(layout.pool_pages))
        self.free_state = list(range(layout.state_slots))
        self.live: Dict[int, Dict[str, Any]] = {}

    def start(self, room: int) -> None:
        self.live[room] = {"sender": self.manager.create_sender(room), "sent": False}

    def fill_and_send(self, room: int, entry: Dict[str, Any]) -> None:
        cfg, layout = self.cfg, self.layout
        seed = cfg.get("seed", 1)
        shape = shape_of(seed, room, cfg.get("max_pages", 4), cfg.get("max_chunks", 1))
        rng = random.Random(seed * 7919 + room * 31 + self.tp_rank)
        pages = pick_pages(rng, self.free, shape.pages)
        full = layout.page_bytes(1)
        for b, pool in enumerate(self.kv):
            for pos, page in enumerate(pages):
                pool[page] = rank_slice(full_page(seed, room, b, pos, full), self.tp_size,
                                        self.tp_rank, layout.mla)
        state_slots: List[int] = []
        if self.state:
            state_slots = pick_pages(rng, self.free_state, 1)
            for s, pool in enumerate(self.state):
                pool[state_slots[0]] = full_page(seed, room, STATE_BUFFER_BASE + s, 0,
                                                 layout.state_item_bytes)
        slot = self.slots.alloc()
        assert slot is not None, "metadata slots exhausted"
        self.aux.output_ids[slot, 0] = aux_token(room)
        self.aux.bootstrap_room[slot, 0] = room
        entry.update(pages=pages, state_slots=state_slots, slot=slot, sent=True)
        sender = entry["sender"]
        sender.init(shape.pages, slot)
        start = 0
        sizes = shape.chunk_sizes()
        for c, size in enumerate(sizes):
            last = c == len(sizes) - 1
            chunk = np.asarray(pages[start:start + size], dtype=np.int32)
            sender.send(chunk, last, np.asarray(state_slots, np.int32) if last else None)
            start += size

    def step(self) -> List[str]:
        """Drives every live sender one step; returns ROOM lines of those that ended."""
        lines = []
        for room in list(self.live):
            entry = self.live[room]
            sender = entry["sender"]
            state = sender.poll()
            if state == pdlib.KVPoll.WaitingForInput and not entry["sent"] \
                    and not self.cfg.get("hold"):
                try:
                    self.fill_and_send(room, entry)
                except pdlib.Error as e:
                    sender.abort(f"send failed: {e}")
                continue
            if not state.is_terminal:
                continue
            if not sender.pages_reusable():
                continue  # pages still read by writes in flight: keep them
            reason = sender.failure_reason()
            lines.append(f"ROOM {room} {self.tp_rank} {state.name} {reason or 'OK'}")
            self.free.extend(entry.get("pages", []))
            self.free_state.extend(entry.get("state_slots", []))
            if entry.get("slot") is not None:
                self.slots.free(entry["slot"])
            sender.close()
            del self.live[room]
        return lines


def main() -> int:
    cfg = json.loads(sys.argv[1])
    if cfg.get("log_level"):
        pdlib.set_log_level(pdlib.LogLevel[cfg["log_level"]])
    layout = Layout.from_dict(cfg.get("layout", {}))
    deadline = time.monotonic() + cfg.get("max_seconds", 60)
    try:
        ranks = [Rank(cfg, layout, r) for r in range(cfg.get("tp_size", 1))]
    except pdlib.Error as e:
        emit(f"ERROR {e}")
        return 1
    emit(f"READY port={cfg['bootstrap_port']} endpoint={ranks[0].manager.endpoint}")
    pending = list(cfg.get("rooms", []))
    concurrency = cfg.get("concurrency", 8)
    ok = failed = 0
    outstanding = len(pending) * len(ranks)
    while outstanding > 0:
        if time.monotonic() > deadline:
            emit("TIMEOUT")
            os._exit(3)
        while pending and len(ranks[0].live) < concurrency:
            room = pending.pop(0)
            for rank in ranks:
                rank.start(room)
        progressed = False
        for rank in ranks:
            for line in rank.step():
                emit(line)
                progressed = True
                outstanding -= 1
                if " Success " in line:
                    ok += 1
                else:
                    failed += 1
        if not progressed:
            time.sleep(0.0005)
    emit(f"DONE ok={ok} failed={failed}")
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "QUIT":
                break
    for rank in ranks:
        rank.manager.close()
    emit("BYE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
