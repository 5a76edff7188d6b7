"""A toy router and two vLLM-shaped engine processes (prefill, decode) joined by pdlib.vllm.

Each engine is python/tests/vllm_engine.py: vLLM's scheduler and worker call sequence around
PdlibConnector (built through a stand-in of vLLM's KVConnectorFactory, python/tests/vllm_standin,
since vLLM itself is not installed here), with torch CPU KV caches in the layout vLLM allocates
since 2026-07-11 (--kv-layout packed: K and V packed in each row, HND) or the older
(2, num_blocks, ...) one. The router does what NIXL's toy proxy does: it sends prefill each request with
do_remote_decode and max_tokens=1, copies the kv_transfer_params of the answer into the decode
request, and keeps --concurrency requests in flight. It prints, per request, the blocks and
bytes decode pulled and the time of each leg, then the throughput; with --cxx-bench it also runs
pdlib-transfer-bench --direction pull with the same shape (layers, block bytes, blocks per
request, requests, concurrency) and prints connector / C++.

    PYTHONPATH=<build>/python python3 examples/python/vllm_pair.py \
        [--requests 64] [--concurrency 4] [--layers 32] [--heads 8] [--head-dim 128] \
        [--block-size 16] [--blocks 16] [--tls shm|tcp] [--layout scattered|contiguous] \
        [--prefill-tp 1] [--decode-tp 1] [--kv-layout packed|kv_first] \
        [--cxx-bench build/release/bench/transfer/pdlib-transfer-bench] [--repeat 1] [--quiet]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "..", "..", "python", "tests", "vllm_engine.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One engine process; its JSON events go to the router's queue, tagged with its name."""

    def __init__(self, name: str, cfg: Dict[str, Any], events: "queue.Queue[Tuple[str, Any]]"):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, ENGINE, json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: "queue.Queue[Tuple[str, Any]]") -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            events.put((self.name, json.loads(line)))
        events.put((self.name, {"event": "exit"}))

    def send(self, cmd: Dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def engine_cfg(a: argparse.Namespace, tp: int, salt: int, tls: Dict[str, str],
               num_blocks: int) -> Dict[str, Any]:
    return {"layout": a.kv_layout, "tp": tp, "salt": salt, "remote_salt": 1,
            "block_size": a.block_size, "heads": a.heads, "head_dim": a.head_dim,
            "layers": a.layers, "num_blocks": num_blocks, "model": False,
            "pool_mode": "prefill" if salt == 1 else "decode",
            "kv_role": "kv_producer" if salt == 1 else "kv_consumer",
            "scatter_blocks": a.layout == "scattered",
            "enable_prefix_caching": False,
            "extra": {"backend": "ucx", "backend_options": tls, "bootstrap_host": "127.0.0.1",
                      "bootstrap_port": free_port(), "pull_lease": 60.0}}


def run(a: argparse.Namespace, tls: Dict[str, str]) -> Optional[Dict[str, Any]]:
    events: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
    total = a.warmup + a.requests
    in_use = 2 * a.concurrency * a.blocks + 2
    prefill = Engine("prefill", engine_cfg(a, a.prefill_tp, 1, tls, in_use), events)
    decode = Engine("decode", engine_cfg(a, a.decode_tp, 2, tls, in_use), events)
    engines = {"prefill": prefill, "decode": decode}
    try:
        ready = 0
        while ready < 2:
            name, e = events.get(timeout=120)
            if e["event"] != "ready":
                print(f"{name}: {e}", file=sys.stderr)
                return None
            ready += 1
        tokens = a.blocks * a.block_size
        block_bytes = a.layers * 2 * a.heads * a.head_dim * 2 * a.block_size
        started: Dict[str, float] = {}
        prefilled: Dict[str, float] = {}
        pulled: Dict[str, float] = {}
        next_id, in_flight, done = 0, 0, 0
        rows: List[Tuple[str, int, float, float]] = []
        t_first: Optional[float] = None
        while done < total:
            while in_flight < a.concurrency and next_id < total:
                rid = f"r{next_id}"
                # Distinct prompts (no prefix hits): token values from the request number.
                prompt = [(next_id * 7919 + i) % 30000 + 1 for i in range(tokens)]
                if next_id == a.warmup:
                    t_first = time.monotonic()
                started[rid] = time.monotonic()
                prefill.send({"op": "add", "id": rid, "prompt": prompt, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True,
                                                     "do_remote_prefill": False}})
                started[rid + "/prompt"] = prompt  # type: ignore[assignment]
                next_id, in_flight = next_id + 1, in_flight + 1
            name, e = events.get(timeout=120)
            kind, rid = e["event"], e.get("id")
            if kind in ("error", "exit"):
                print(f"{name}: {e}", file=sys.stderr)
                return None
            if name == "prefill" and kind == "finished":
                prefilled[rid] = time.monotonic()
                decode.send({"op": "add", "id": rid, "prompt": started.pop(rid + "/prompt"),
                             "max_tokens": 1, "kv_transfer_params": e["kv_transfer_params"]})
            elif name == "decode" and kind == "received":
                pulled[rid] = time.monotonic()
                if e["invalid"]:
                    print(f"{rid}: blocks {e['invalid']} failed to load", file=sys.stderr)
                    return None
                rows.append((rid, len(e["blocks"]), (prefilled[rid] - started[rid]) * 1e3,
                             (pulled[rid] - prefilled[rid]) * 1e3))
                # The pull is over: the next request may start (decode still computes this
                # one's last prompt token and finishes it, off the transfer's clock).
                in_flight -= 1
            elif name == "decode" and kind == "finished":
                done += 1
        t_end = max(pulled[f"r{i}"] for i in range(a.warmup, total))
        decode.send({"op": "stats"})
        while True:
            name, e = events.get(timeout=60)
            if name == "decode" and e["event"] == "stats":
                pulled_bytes = e["decode_bytes"]
                break
        if not a.quiet:
            print(f"{'request':>8} {'blocks':>6} {'bytes pulled':>13} {'prefill ms':>10} "
                  f"{'pull ms':>8}")
            for rid, blocks, p_ms, d_ms in rows:
                print(f"{rid:>8} {blocks:>6} {blocks * block_bytes:>13} {p_ms:>10.2f} "
                      f"{d_ms:>8.2f}")
        measured = a.requests * a.blocks * block_bytes
        assert pulled_bytes == total * a.blocks * block_bytes, (pulled_bytes, total)
        assert t_first is not None
        return {"gbytes_per_s": measured / (t_end - t_first) / 1e9, "bytes": measured,
                "pdlib_decode_bytes": pulled_bytes}
    finally:
        for e in engines.values():
            e.close()


def run_cxx(binary: str, a: argparse.Namespace, tls: Dict[str, str]) -> Optional[float]:
    # The same KV shape: pdlib-transfer-bench registers a K and a V buffer per layer; vLLM's
    # packed layout (K and V in each row, since 2026-07) is one buffer per layer of twice the
    # block bytes, i.e. half as many "layers" of twice the item.
    item = a.block_size * a.heads * a.head_dim * 2
    layers = a.layers
    if a.kv_layout == "packed":
        layers, item = a.layers // 2, 2 * item
    cmd = [binary, "--backend", "ucx", "--layers", str(layers), "--item-bytes",
           str(item), "--pages", str(a.blocks), "--layout",
           a.layout, "--pool-pages", str(2 * a.concurrency * a.blocks + 2), "--requests",
           str(a.requests), "--warmup", str(a.warmup), "--concurrency", str(a.concurrency),
           "--json", "--direction", "pull"]
    for k, v in tls.items():
        cmd += ["--backend-option", f"{k}={v}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"pdlib-transfer-bench failed: {e}", file=sys.stderr)
        return None
    for line in out.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["gbytes_per_s"])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per request (prompt length "
                    "= blocks x block size)")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--tls", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--layout", choices=["scattered", "contiguous"], default="scattered",
                    help="a request's blocks: scattered over the pool (as after churn, and as "
                         "pdlib-transfer-bench's default) or consecutive")
    ap.add_argument("--kv-layout", choices=["packed", "kv_first"], default="packed",
                    help="vLLM's KV cache layout: packed K/V (since 2026-07-11) or the older "
                         "(2, num_blocks, ...) one")
    ap.add_argument("--cxx-bench", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each side, best kept")
    ap.add_argument("--quiet", action="store_true", help="no per-request lines")
    a = ap.parse_args()
    tls = {"ucx.tls": "shm"} if a.tls == "shm" else {"ucx.tls": "tcp", "ucx.net_devices": "lo"}
    best_py: Optional[float] = None
    best_cxx: Optional[float] = None
    for _ in range(a.repeat):  # interleaved: the two share the machine and its noise
        r = run(a, tls)
        if r is None:
            return 1
        best_py = max(best_py or 0.0, r["gbytes_per_s"])
        if a.cxx_bench:
            cxx = run_cxx(a.cxx_bench, a, tls)
            if cxx is not None:
                best_cxx = max(best_cxx or 0.0, cxx)
    assert best_py is not None
    result: Dict[str, Any] = {"connector_gbytes_per_s": best_py, "tls": a.tls,
                              "timed": "router, end to end",
                              "block_bytes": a.layers * 2 * a.heads * a.head_dim * 2 *
                              a.block_size, "blocks_per_request": a.blocks,
                              "requests": a.requests, "concurrency": a.concurrency,
                              "layout": a.layout, "kv_layout": a.kv_layout}
    line = f"pdlib.vllm connector, ucx {a.tls} ({result['timed']}): {best_py:.2f} GB/s"
    if best_cxx:
        result["cxx_pull_gbytes_per_s"] = best_cxx
        result["ratio"] = best_py / best_cxx
        line += f"; pdlib-transfer-bench --direction pull: {best_cxx:.2f} GB/s; " \
                f"ratio {best_py / best_cxx:.1%} (target >= 95%)"
    print(line)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
