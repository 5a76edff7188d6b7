"""Minimal prefill and decode schedulers that drive pdlib.sglang the way SGLang's schedulers
drive a transfer backend (disaggregation/prefill.py and decode.py), for the tests and the
examples: a bootstrap queue, a waiting queue and an in-flight queue on prefill; a pre-allocation
queue and a transfer queue on decode, polled through poll_and_all_reduce.

Pages hold the kvpattern bytes, so decode checks every byte it received. Pool sizes are in
pages; a request of n pages is sent in `chunks` chunks of whole pages (chunked prefill).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import pdlib
from pdlib import sglang as pd
from kvpattern import STATE_BUFFER_BASE, Layout, aux_token, full_page, pick_pages, rank_slice


def make_kv_args(layout: Layout, pools: List[np.ndarray], aux: pdlib.MetadataBuffers,
                 tp_size: int, tp_rank: int, state_pools: Optional[List[np.ndarray]] = None
                 ) -> pd.KVArgs:
    """SGLang's KVArgs for KV pools [pages, page_bytes] (one per layer and K/V buffer)."""
    a = pd.KVArgs()
    a.engine_rank = tp_rank
    a.kv_data_ptrs = [p.ctypes.data for p in pools]
    a.kv_data_lens = [p.nbytes for p in pools]
    a.kv_item_lens = [p[0].nbytes for p in pools]
    family = aux.describe()
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = family.ptrs, family.lens, family.item_lens
    if state_pools:
        a.state_data_ptrs = [p.ctypes.data for p in state_pools]
        a.state_data_lens = [p.nbytes for p in state_pools]
        a.state_item_lens = [p[0].nbytes for p in state_pools]
        a.state_type = "mamba"
    a.kv_head_num = 1 if layout.mla else layout.heads // tp_size
    a.total_kv_head_num = 1 if layout.mla else layout.heads
    a.page_size = layout.page_size
    a.kv_layout = pdlib.KVLayout.HND  # the test pattern's layout (kvpattern)
    a.model_name = "pdlib-sglang-test"
    return a


class ServerArgs:
    def __init__(self, **kw: Any):
        self.tp_size = 1
        self.dp_size = 1
        self.pp_size = 1
        self.disaggregation_bootstrap_port = 8998
        self.pdlib_backend = "fake"
        self.pdlib_backend_options: Dict[str, str] = {}
        self.pdlib_liveness_timeout = 1.0
        self.pdlib_connect_timeout = 3.0
        self.__dict__.update(kw)


class PrefillRank:
    """One prefill TP rank: pools, metadata and the SGLang-shaped manager."""

    def __init__(self, layout: Layout, server_args: ServerArgs, tp_rank: int, seed: int):
        self.layout, self.seed, self.tp_rank = layout, seed, tp_rank
        self.tp_size = server_args.tp_size
        page_bytes = layout.page_bytes(self.tp_size)
        self.pools = [np.zeros((layout.pool_pages, page_bytes), np.uint8)
                      for _ in range(layout.kv_buffers)]
        self.state_pools = [np.zeros((layout.state_slots, layout.state_item_bytes), np.uint8)
                            for _ in range(layout.state_buffers)]
        self.aux = pdlib.MetadataBuffers(64)
        self.slots = pdlib.MetadataSlotAllocator(64)
        args = make_kv_args(layout, self.pools, self.aux, self.tp_size, tp_rank,
                            self.state_pools)
        self.mgr = pd.KVManager(args, pd.DisaggregationMode.PREFILL, server_args, layout.mla)
        self.free = list(range(layout.pool_pages))
        self.free_state = list(range(layout.state_slots))


class PrefillScheduler:
    """SGLang's prefill loop: bootstrap queue -> waiting queue (forward, chunked sends) ->
    in-flight queue (poll until terminal, then release)."""

    def __init__(self, ranks: List[PrefillRank], bootstrap_addr: str, chunks: int = 1,
                 abort_rooms: Optional[set] = None):
        self.ranks = ranks
        self.bootstrap_addr = bootstrap_addr
        self.chunks = chunks
        self.abort_rooms = abort_rooms or set()
        self.bootstrap: List[Dict[str, Any]] = []
        self.waiting: List[Dict[str, Any]] = []
        self.inflight: List[Dict[str, Any]] = []
        self.done: Dict[int, pdlib.KVPoll] = {}
        self.errors: Dict[int, str] = {}

    def add(self, room: int, num_pages: int) -> None:
        senders = [pd.KVSender(r.mgr, self.bootstrap_addr, room, [0], 0) for r in self.ranks]
        self.bootstrap.append(dict(room=room, pages=num_pages, senders=senders, sent=0))

    def _poll(self, req: Dict[str, Any]) -> pdlib.KVPoll:
        return min(s.poll() for s in req["senders"])  # what poll_and_all_reduce would say

    def step(self) -> None:
        for req in list(self.bootstrap):
            state = self._poll(req)
            if state == pdlib.KVPoll.Failed:
                self._finish(req, self.bootstrap)
            elif state == pdlib.KVPoll.WaitingForInput:
                self.bootstrap.remove(req)
                self._forward_prepare(req)
                self.waiting.append(req)
        for req in list(self.waiting):  # one chunk per request per step, like chunked prefill
            if req["room"] in self.abort_rooms:
                for s in req["senders"]:
                    s.abort()
                self.waiting.remove(req)
                self.inflight.append(req)
                continue
            self._send_chunk(req)
            if req["sent"] == req["pages"]:
                self.waiting.remove(req)
                self.inflight.append(req)
        for req in list(self.inflight):
            if self._poll(req) in (pdlib.KVPoll.Success, pdlib.KVPoll.Failed):
                self._finish(req, self.inflight)

    def _forward_prepare(self, req: Dict[str, Any]) -> None:
        """The "forward pass": each rank writes the request's KV into pages of its pool."""
        room = req["room"]
        req["rank_pages"], req["rank_slots"], req["rank_state"] = [], [], []
        for rank, sender in zip(self.ranks, req["senders"]):
            rng = random.Random(rank.seed * 7 + room * 13 + rank.tp_rank)
            pages = pick_pages(rng, rank.free, req["pages"])
            full = rank.layout.page_bytes(1)
            for b, pool in enumerate(rank.pools):
                for pos, page in enumerate(pages):
                    pool[page] = rank_slice(full_page(rank.seed, room, b, pos, full),
                                            rank.tp_size, rank.tp_rank, rank.layout.mla)
            state = pick_pages(rng, rank.free_state, 1) if rank.state_pools else []
            for s, pool in enumerate(rank.state_pools):
                pool[state[0]] = full_page(rank.seed, room, STATE_BUFFER_BASE + s, 0,
                                           rank.layout.state_item_bytes)
            slot = rank.slots.alloc()
            rank.aux.output_ids[slot, 0] = aux_token(room)
            rank.aux.bootstrap_room[slot, 0] = room
            sender.init(req["pages"], slot)
            req["rank_pages"].append(pages)
            req["rank_slots"].append(slot)
            req["rank_state"].append(state)

    def _send_chunk(self, req: Dict[str, Any]) -> None:
        per_chunk = max(1, req["pages"] // self.chunks)
        start = req["sent"]
        end = req["pages"] if req["pages"] - start < 2 * per_chunk else start + per_chunk
        for rank_index, sender in enumerate(req["senders"]):
            chunk = np.asarray(req["rank_pages"][rank_index][start:end], np.int32)
            state = req["rank_state"][rank_index] if end == req["pages"] else None
            sender.send(chunk, state)
        req["sent"] = end

    def _finish(self, req: Dict[str, Any], queue: List[Dict[str, Any]]) -> None:
        queue.remove(req)
        state = self._poll(req)
        self.done[req["room"]] = state
        if state == pdlib.KVPoll.Failed:
            try:
                req["senders"][0].failure_exception()
            except pd.KVTransferError as e:
                self.errors[req["room"]] = str(e)
        for rank_index, (rank, sender) in enumerate(zip(self.ranks, req["senders"])):
            if "rank_pages" in req and sender.pages_reusable():
                rank.free.extend(req["rank_pages"][rank_index])
                rank.free_state.extend(req["rank_state"][rank_index])
                rank.slots.free(req["rank_slots"][rank_index])
            sender.clear()


class DecodeScheduler:
    """SGLang's decode loop for one decode instance with `tp` ranks held here: pre-allocation
    queue (receivers bootstrap; pages are allocated and init() sent once every rank agrees,
    through poll_and_all_reduce) and transfer queue (poll until Success, then the bytes are
    checked)."""

    def __init__(self, layout: Layout, server_args: ServerArgs, bootstrap_addr: str, seed: int,
                 group_for_rank: Optional[Callable[[int], Any]] = None):
        self.layout, self.seed = layout, seed
        self.bootstrap_addr = bootstrap_addr
        self.tp_size = server_args.tp_size
        self.ranks: List[Dict[str, Any]] = []
        for r in range(self.tp_size):
            page_bytes = layout.page_bytes(self.tp_size)
            pools = [np.zeros((layout.pool_pages, page_bytes), np.uint8)
                     for _ in range(layout.kv_buffers)]
            state_pools = [np.zeros((layout.state_slots, layout.state_item_bytes), np.uint8)
                           for _ in range(layout.state_buffers)]
            aux = pdlib.MetadataBuffers(64)
            args = make_kv_args(layout, pools, aux, self.tp_size, r, state_pools)
            mgr = pd.KVManager(args, pd.DisaggregationMode.DECODE, server_args, layout.mla)
            self.ranks.append(dict(mgr=mgr, pools=pools, state=state_pools, aux=aux))
        self.group_for_rank = group_for_rank
        self.free = list(range(layout.pool_pages))
        self.free_state = list(range(layout.state_slots))
        self.slots = pdlib.MetadataSlotAllocator(64)
        self.prealloc: List[Dict[str, Any]] = []
        self.transfer: List[Dict[str, Any]] = []
        self.done: Dict[int, pdlib.KVPoll] = {}
        self.errors: Dict[int, str] = {}
        self.quarantined: Dict[int, Dict[str, Any]] = {}

    def add(self, room: int, num_pages: int) -> None:
        receivers = [pd.KVReceiver(rank["mgr"], self.bootstrap_addr, room)
                     for rank in self.ranks]
        self.prealloc.append(dict(room=room, pages=num_pages, receivers=receivers))

    def _reduce(self, reqs: List[Dict[str, Any]]) -> List[pdlib.KVPoll]:
        """poll_and_all_reduce per rank; the ranks are threads of one process here, so each
        rank's MIN is taken over all ranks' states (what the collective computes)."""
        if not reqs:
            return []
        per_rank = [pdlib.poll_and_all_reduce([req["receivers"][r].handle for req in reqs])
                    for r in range(self.tp_size)]
        return [min(states) for states in zip(*per_rank)]

    def step(self) -> None:
        for req, state in zip(list(self.prealloc), self._reduce(self.prealloc)):
            if state == pdlib.KVPoll.Failed:
                self.prealloc.remove(req)
                self._finish(req, state)
            elif state == pdlib.KVPoll.WaitingForInput and len(self.free) >= req["pages"] \
                    and self.slots.available > 0:
                self.prealloc.remove(req)
                rng = random.Random(self.seed * 31 + req["room"])
                req["kv_pages"] = pick_pages(rng, self.free, req["pages"])
                req["state"] = pick_pages(rng, self.free_state, 1) if self.layout.state_buffers \
                    else []
                req["slot"] = self.slots.alloc()
                for r in req["receivers"]:
                    r.init(np.asarray(req["kv_pages"], np.int32), req["slot"],
                           np.asarray(req["state"], np.int32) if req["state"] else None)
                self.transfer.append(req)
        for req, state in zip(list(self.transfer), self._reduce(self.transfer)):
            if state in (pdlib.KVPoll.Success, pdlib.KVPoll.Failed):
                self.transfer.remove(req)
                self._finish(req, state)
        for room, req in list(self.quarantined.items()):
            if all(r.pages_reusable() for r in req["receivers"]):
                self._release(req)
                del self.quarantined[room]

    def _finish(self, req: Dict[str, Any], state: pdlib.KVPoll) -> None:
        room = req["room"]
        self.done[room] = state
        if state == pdlib.KVPoll.Success:
            if self.layout and req["receivers"][0].kv_mgr.options.backend != "fake":
                self.verify(req)
        else:
            for r in req["receivers"]:
                if r.poll() == pdlib.KVPoll.Failed:
                    try:
                        r.failure_exception()
                    except pd.KVTransferError as e:
                        self.errors[room] = str(e)
                        break
                else:
                    r.abort()  # another rank failed: all ranks drop the request
            self.errors.setdefault(room, "failed on another rank")
        if "kv_pages" not in req:
            for r in req["receivers"]:
                r.clear()
        elif all(r.pages_reusable() for r in req["receivers"]):
            self._release(req)
        else:
            self.quarantined[room] = req  # pdlib's page-reuse rule: not before it says so

    def _release(self, req: Dict[str, Any]) -> None:
        self.free.extend(req.get("kv_pages", []))
        self.free_state.extend(req.get("state", []))
        if req.get("slot") is not None:
            self.slots.free(req["slot"])
        for r in req["receivers"]:
            r.clear()

    def verify(self, req: Dict[str, Any]) -> None:
        room, layout = req["room"], self.layout
        full = layout.page_bytes(1)
        for r, rank in enumerate(self.ranks):
            for b, pool in enumerate(rank["pools"]):
                for pos, page in enumerate(req["kv_pages"]):
                    expected = rank_slice(full_page(self.seed, room, b, pos, full),
                                          self.tp_size, r, layout.mla)
                    assert np.array_equal(pool[page], expected), \
                        f"room {room}: rank {r} buffer {b} page_pos {pos} differs"
            for s, pool in enumerate(rank["state"]):
                expected = full_page(self.seed, room, STATE_BUFFER_BASE + s, 0,
                                     layout.state_item_bytes)
                assert np.array_equal(pool[req["state"][0]], expected), f"room {room}: state"
            assert int(rank["aux"].output_ids[req["slot"], 0]) == aux_token(room)
            assert int(rank["aux"].bootstrap_room[req["slot"], 0]) == room

    def idle(self) -> bool:
        return not self.prealloc and not self.transfer

    def close(self) -> None:
        for rank in self.ranks:
            rank["mgr"].close()
