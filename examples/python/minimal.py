"""The README's Python example: one prefill and one decode manager in one process (pdlib's
in-process control plane), a request of three KV pages and its metadata slot, every byte checked.

    python3 examples/python/minimal.py [--backend ucx|fake]

With `ucx` (the default when it is built) the pages move through UCX shared memory; `fake`
copies them in process (fake.copy). Prints one line and exits 0 when every byte arrived.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

import numpy as np

import pdlib

LAYERS, PAGES, PAGE_BYTES, PAGE_TOKENS = 2, 16, 4096, 16


def manager(mode: pdlib.Mode, backend: str, port: int,
            pools: list[np.ndarray], aux: pdlib.MetadataBuffers) -> pdlib.KVManager:
    o = pdlib.KVManagerOptions(mode=mode, backend=backend, bootstrap_port=port,
                               control_plane=pdlib.ControlPlane.InProcess)
    o.backend_options = {"ucx.tls": "shm"} if backend == "ucx" else {"fake.copy": "true"}
    for pool in pools:                       # one buffer per layer and K/V; an item is a page
        o.args.kv.add(pool, item_len=PAGE_BYTES)
    o.args.aux = aux.describe()              # the metadata slots (first token, ...)
    o.args.page_size = PAGE_TOKENS
    o.args.fingerprint = pdlib.ModelFingerprint(LAYERS, 8, 128, 2, 1, "my-model")
    return pdlib.KVManager.create(o)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ucx" if "ucx" in pdlib.list_backends() else "fake")
    backend = ap.parse_args().backend
    with socket.socket() as s:               # a free port for the bootstrap address
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(2 * LAYERS)]
    dst = [np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(2 * LAYERS)]
    src_aux, dst_aux = pdlib.MetadataBuffers(4), pdlib.MetadataBuffers(4)
    prefill = manager(pdlib.Mode.Prefill, backend, port, src, src_aux)
    decode = manager(pdlib.Mode.Decode, backend, port, dst, dst_aux)

    room = 42                                # the request's id, the same on both sides
    receiver = decode.create_receiver(f"127.0.0.1:{port}", room)
    sender = prefill.create_sender(room)
    receiver.init([9, 3, 11], aux_index=1)   # decode's pages for the prompt, its metadata slot
    while sender.poll() < pdlib.KVPoll.WaitingForInput:
        time.sleep(0.001)                    # decode's pages have reached prefill
    src_aux.output_ids[0, 0] = 1234          # the first output token, in prefill's slot 0
    src_aux.bootstrap_room[0, 0] = room      # and the room it belongs to (decode checks it)
    sender.init(3, 0)                        # 3 pages; metadata slot 0
    sender.send([0, 1, 2], is_last_chunk=True)
    deadline = time.monotonic() + 30
    ended = (pdlib.KVPoll.Success, pdlib.KVPoll.Failed)
    while receiver.poll() not in ended or sender.poll() not in ended:
        if time.monotonic() > deadline:
            print("minimal: timed out", file=sys.stderr)
            return 1
        time.sleep(0.001)
    if receiver.poll() != pdlib.KVPoll.Success:
        print(f"minimal: failed: {receiver.failure_reason()}", file=sys.stderr)
        return 1
    for s, d in zip(src, dst):               # every byte of every page, and the first token
        for i, j in zip([0, 1, 2], [9, 3, 11]):
            if not np.array_equal(s[i * PAGE_BYTES:(i + 1) * PAGE_BYTES],
                                  d[j * PAGE_BYTES:(j + 1) * PAGE_BYTES]):
                print(f"minimal: page {j} differs", file=sys.stderr)
                return 1
    assert dst_aux.output_ids[1, 0] == 1234
    print(f"minimal: 3 pages x {2 * LAYERS} buffers and the first token arrived over {backend}")
    sender.close(), receiver.close(), prefill.close(), decode.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
