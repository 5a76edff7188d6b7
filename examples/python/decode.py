"""Example decode server rank (of 2 TP ranks) driving pdlib.sglang like SGLang's decode
scheduler, checking every byte it receives.

    python3 decode.py --rank R --world 2 --dist-port P --bootstrap-port 8998 --requests 64

The two ranks are two processes joined by torch.distributed (gloo on 127.0.0.1). Per request
each rank creates a KVReceiver (pre-allocation queue); once every rank's receiver has
bootstrapped - agreed through pdlib.poll_and_all_reduce over pdlib.TorchProcessGroup, which
MIN-reduces the states so a failure on any rank fails the request everywhere - pages are
allocated (the same on every rank, as SGLang's ranks share the allocator's decisions) and
init() sends them to prefill (transfer queue). Success on every rank: the rank checks every byte
of its head slice and the first output token.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import pdlib
from pdlib import sglang as pd

from common import Model, first_token, head_slice, kv_pools, page_content, requests


def report_failure(rank: int, receiver: pd.KVReceiver) -> None:
    try:
        receiver.failure_exception()
    except pd.KVTransferError as e:
        print(f"decode rank {rank}: {e}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--bootstrap-port", type=int, default=8998)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--backend", default="ucx" if "ucx" in pdlib.list_backends() else "fake")
    ap.add_argument("--tls", default="shm")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.dist_port}",
                            rank=a.rank, world_size=a.world)
    group = pdlib.TorchProcessGroup()
    model = Model()

    pools = kv_pools(model, tp_size=a.world)
    pool_bits = [p.view(torch.int16) for p in pools]
    aux = pdlib.MetadataBuffers(pdlib.MetadataBuffers.slot_count_for(64))
    slots = pdlib.MetadataSlotAllocator(aux.num_slots)
    args = pd.KVArgs()
    args.engine_rank = a.rank
    args.kv_data_ptrs = [p.data_ptr() for p in pools]
    args.kv_data_lens = [p.numel() * p.element_size() for p in pools]
    args.kv_item_lens = [p[0].numel() * p.element_size() for p in pools]
    family = aux.describe()
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = (family.ptrs, family.lens,
                                                                   family.item_lens)
    args.kv_head_num = model.heads // a.world
    args.total_kv_head_num = model.heads
    args.page_size = model.page_size
    args.model_name = "example-model"
    server_args = argparse.Namespace(
        tp_size=a.world, dp_size=1, pp_size=1, disaggregation_bootstrap_port=a.bootstrap_port,
        pdlib_backend=a.backend,
        pdlib_backend_options={"ucx.tls": a.tls, **({"ucx.net_devices": "lo"}
                                                    if a.tls == "tcp" else {})})
    mgr = pd.KVManager(args, pd.DisaggregationMode.DECODE, server_args, is_mla_backend=False)

    free = list(range(model.pool_pages))
    rng = random.Random(a.seed * 7)  # the same on every rank: both pick the same pages
    prealloc, transfer = [], []
    for room, tokens in requests(a.seed, a.requests, a.max_tokens):
        receiver = pd.KVReceiver(mgr, f"127.0.0.1:{a.bootstrap_port}", room)
        prealloc.append(dict(room=room, pages=pdlib.page_count(tokens, model.page_size),
                             receiver=receiver))
    ok = failed = 0
    checked_bytes = 0
    deadline = time.monotonic() + a.timeout
    while prealloc or transfer:
        if time.monotonic() > deadline:
            print(f"decode rank {a.rank}: timed out", file=sys.stderr)
            return 1
        # Every rank runs the same steps in the same order: the collectives line up.
        states = pdlib.poll_and_all_reduce([r["receiver"].handle for r in prealloc], group)
        for req, state in zip(list(prealloc), states):
            if state == pdlib.KVPoll.Failed:
                prealloc.remove(req)
                failed += 1
                req["receiver"].abort()  # failed on some rank: drop it here too
                report_failure(a.rank, req["receiver"])
                req["receiver"].clear()
            elif state == pdlib.KVPoll.WaitingForInput and len(free) >= req["pages"]:
                prealloc.remove(req)
                req["kv_pages"] = rng.sample(free, req["pages"])
                for p in req["kv_pages"]:
                    free.remove(p)
                req["slot"] = slots.alloc()
                req["receiver"].init(np.asarray(req["kv_pages"], np.int32), req["slot"])
                transfer.append(req)
        states = pdlib.poll_and_all_reduce([r["receiver"].handle for r in transfer], group)
        for req, state in zip(list(transfer), states):
            if state not in (pdlib.KVPoll.Success, pdlib.KVPoll.Failed):
                continue
            transfer.remove(req)
            if state == pdlib.KVPoll.Success:
                for b, bits in enumerate(pool_bits):
                    for pos, page in enumerate(req["kv_pages"]):
                        want = head_slice(page_content(req["room"], b, pos, model), a.world,
                                          a.rank)
                        if not torch.equal(bits[page], want):
                            print(f"decode rank {a.rank}: room {req['room']} buffer {b} page "
                                  f"{pos}: bytes differ", file=sys.stderr)
                            return 1
                        checked_bytes += want.numel() * 2
                assert int(aux.output_ids[req["slot"], 0]) == first_token(req["room"])
                ok += 1
            else:
                failed += 1
                req["receiver"].abort()  # failed on some rank: drop it here too
                report_failure(a.rank, req["receiver"])
            # pdlib's page-reuse rule: a failed request's pages wait until reusable.
            while not req["receiver"].pages_reusable():
                time.sleep(0.001)
            free.extend(req["kv_pages"])
            slots.free(req["slot"])
            req["receiver"].clear()
        time.sleep(0.0002)
    print(f"decode rank {a.rank}: {ok} received, {failed} failed, {checked_bytes} bytes checked",
          flush=True)
    mgr.close()
    dist.destroy_process_group()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
