"""Example prefill server (one TP rank) driving pdlib.sglang like SGLang's prefill scheduler.

    python3 prefill.py --bootstrap-port 8998 --requests 64 [--backend ucx --tls shm]

It hosts the bootstrap server (KVBootstrapServer, as SGLang's prefill does), then for every
request: a KVSender joins the bootstrap queue; once decode has sent its pages
(poll() == WaitingForInput) the request is "prefilled" (its KV pages written into the torch
pools) and sent in chunks of whole pages (chunked prefill); it then sits in the in-flight queue
until Success or Failed, and its pages go back to the pool once pdlib says they are reusable.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

import pdlib
from pdlib import sglang as pd

from common import Model, first_token, kv_pools, page_content, requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap-port", type=int, default=8998)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--chunk-pages", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--backend", default="ucx" if "ucx" in pdlib.list_backends() else "fake")
    ap.add_argument("--tls", default="shm", help="ucx.tls (shm, tcp)")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    model = Model()
    server = pd.KVBootstrapServer("127.0.0.1", a.bootstrap_port)

    pools = kv_pools(model, tp_size=1)
    pool_bits = [p.view(torch.int16) for p in pools]
    aux = pdlib.MetadataBuffers(pdlib.MetadataBuffers.slot_count_for(64))
    slots = pdlib.MetadataSlotAllocator(aux.num_slots)
    args = pd.KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = [p.data_ptr() for p in pools]
    args.kv_data_lens = [p.numel() * p.element_size() for p in pools]
    args.kv_item_lens = [p[0].numel() * p.element_size() for p in pools]
    family = aux.describe()
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = (family.ptrs, family.lens,
                                                                   family.item_lens)
    args.kv_head_num = model.heads
    args.total_kv_head_num = model.heads
    args.page_size = model.page_size
    args.model_name = "example-model"
    server_args = argparse.Namespace(
        tp_size=1, dp_size=1, pp_size=1, disaggregation_bootstrap_port=a.bootstrap_port,
        pdlib_backend=a.backend,
        pdlib_backend_options={"ucx.tls": a.tls, **({"ucx.net_devices": "lo"}
                                                    if a.tls == "tcp" else {})})
    mgr = pd.KVManager(args, pd.DisaggregationMode.PREFILL, server_args, is_mla_backend=False)

    free = list(range(model.pool_pages))
    rng = random.Random(a.seed)
    bootstrap_queue, waiting, inflight = [], [], []
    for room, tokens in requests(a.seed, a.requests, a.max_tokens):
        sender = pd.KVSender(mgr, f"127.0.0.1:{a.bootstrap_port}", room, [0], 0)
        bootstrap_queue.append(dict(room=room, pages=pdlib.page_count(tokens, model.page_size),
                                    sender=sender, sent=0))
    ok = failed = 0
    deadline = time.monotonic() + a.timeout
    while bootstrap_queue or waiting or inflight:
        if time.monotonic() > deadline:
            print("prefill: timed out", file=sys.stderr)
            return 1
        for req in list(bootstrap_queue):
            state = req["sender"].poll()
            if state == pdlib.KVPoll.WaitingForInput and len(free) >= req["pages"]:
                bootstrap_queue.remove(req)
                req["kv_pages"] = rng.sample(free, req["pages"])
                for p in req["kv_pages"]:
                    free.remove(p)
                for b, bits in enumerate(pool_bits):  # the "forward pass"
                    for pos, page in enumerate(req["kv_pages"]):
                        bits[page] = page_content(req["room"], b, pos, model)
                req["slot"] = slots.alloc()
                aux.output_ids[req["slot"], 0] = first_token(req["room"])
                aux.bootstrap_room[req["slot"], 0] = req["room"]
                req["sender"].init(req["pages"], req["slot"])
                waiting.append(req)
            elif state == pdlib.KVPoll.Failed:
                bootstrap_queue.remove(req)
                failed += 1
        for req in list(waiting):  # one chunk per request per scheduler step
            chunk = req["kv_pages"][req["sent"]:req["sent"] + a.chunk_pages]
            req["sender"].send(np.asarray(chunk, np.int32))
            req["sent"] += len(chunk)
            if req["sent"] == req["pages"]:
                waiting.remove(req)
                inflight.append(req)
        for req in list(inflight):
            state = req["sender"].poll()
            if state not in (pdlib.KVPoll.Success, pdlib.KVPoll.Failed):
                continue
            if not req["sender"].pages_reusable():
                continue  # a write may still read them
            inflight.remove(req)
            if state == pdlib.KVPoll.Success:
                ok += 1
            else:
                failed += 1
                try:
                    req["sender"].failure_exception()
                except pd.KVTransferError as e:
                    print(f"prefill: {e}", file=sys.stderr)
            free.extend(req["kv_pages"])
            slots.free(req["slot"])
            req["sender"].clear()
        time.sleep(0.0002)
    print(f"prefill: {ok} sent, {failed} failed", flush=True)
    time.sleep(1.0)  # let decode read its last statuses before the manager goes
    mgr.close()
    server.close()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
