"""Benchmarks of pdlib's Python binding against the issue #14 targets, in one run:

  poll      cost of KVReceiver.poll() (and pdlib.sglang's poll()) from Python   target <= 1 us
  send      Python-side time of KVSender.send() with 1,000 page indices        target <= 20 us
            (next to the same call from C++, pdlib_micro_bench's BM_SendCall, in the same run)
  transfer  the KV-shaped two-process transfer driven from Python (32 layers, 32 KiB items,
            16 scattered pages, 64 requests, concurrency 4) over UCX shm and tcp, next to
            pdlib-transfer-bench (C++) with the same shape in the same run: >= 95% of its GB/s;
            --direction pull (or both) runs it in decode pull (issue #29): prefill publishes each
            request as soon as its sender exists and decode reads; both adds pull / push

    PYTHONPATH=build/release/python python3 bench/python/pdlib_py_bench.py \
        [--cxx-bench build/release/bench/transfer/pdlib-transfer-bench] \
        [--cxx-micro-bench build/release/bench/pdlib_micro_bench] [--json out.json]
        [--direction push|pull|both]

Prints a table, then the same figures as one JSON object. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import pdlib

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backoff:
    """An engine loop's idle wait, the same as pdlib-transfer-bench's drivers (Idler in
    bench/transfer/bench_ranks.cc): a pass that changed nothing yields (64 times), then sleeps,
    each sleep twice as long as the last (20 us up to 1 ms); a pass that did resets it. The
    thread's timer slack is 1 us, so that short sleeps stay short (Linux's default, 50 us, makes
    a 20 us sleep last 70). A loop that polls every 20 us keeps a core busy that pdlib's
    progress threads need (2 cores)."""

    def __init__(self, first: float = 20e-6, most: float = 1e-3, spins: int = 64) -> None:
        self.first, self.most, self.delay = first, most, first
        self.spins, self.idle = spins, 0
        _set_timer_slack_ns(1000)

    def wait(self, progressed: bool) -> None:
        if progressed:
            self.delay, self.idle = self.first, 0
            return
        self.idle += 1
        if self.idle <= self.spins:
            os.sched_yield()
            return
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)


def _set_timer_slack_ns(ns: int) -> None:
    """prctl(PR_SET_TIMERSLACK, ns) for the calling thread; nothing where that is unavailable."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, ctypes.c_ulong(ns), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def fake_pair(pages: int, item: int = 64):
    port = free_port()
    managers, keep = [], []
    for mode in (pdlib.Mode.Prefill, pdlib.Mode.Decode):
        o = pdlib.KVManagerOptions(mode=mode, backend="fake",
                                   control_plane=pdlib.ControlPlane.InProcess)
        buf = np.zeros((pages, item), np.uint8)
        keep.append(buf)
        o.args.kv.add(buf)
        o.args.kv.add(np.zeros((pages, item), np.uint8))
        aux = pdlib.MetadataBuffers(8)
        keep.append(aux)
        o.args.aux = aux.describe()
        o.args.page_size = 16
        o.args.fingerprint = pdlib.ModelFingerprint(1, 1, 1, 1, 1, "bench")
        o.bootstrap_port = port
        o.start_bootstrap_server = mode == pdlib.Mode.Prefill
        managers.append(pdlib.KVManager.create(o))
    return managers[0], managers[1], f"127.0.0.1:{port}", keep


def bench_poll(n: int = 1_000_000) -> Dict[str, float]:
    from pdlib import sglang as pd

    prefill, decode, address, _ = fake_pair(16)
    receiver = decode.create_receiver(address, 1)
    poll = receiver.poll
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            poll()
        best = min(best, (time.perf_counter() - start) / n)

    class Wrapped(pd._Handle):  # pdlib.sglang's poll() over the same handle
        def __init__(self, handle):
            self.handle = handle
            self.bootstrap_room = 1

    wpoll = Wrapped(receiver).poll
    best_sglang = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            wpoll()
        best_sglang = min(best_sglang, (time.perf_counter() - start) / n)
    start = time.perf_counter()
    for _ in range(n):
        pass
    loop = (time.perf_counter() - start) / n
    decode.close()
    prefill.close()
    return {"poll_us": best * 1e6, "sglang_poll_us": best_sglang * 1e6, "loop_us": loop * 1e6}


def bench_send(pages: int = 1000, rounds: int = 300) -> Dict[str, float]:
    prefill, decode, address, _ = fake_pair(pages + 8)
    indices = np.arange(pages, dtype=np.int32)
    rng = np.random.default_rng(1)
    times: List[float] = []
    for room in range(1, rounds + 1):
        sender = prefill.create_sender(room)
        receiver = decode.create_receiver(address, room)
        receiver.init(indices, None)
        # Busy polling, as an engine's scheduler loop does and as BM_SendCall does: after a
        # sleep, the same call measures 30-40 us in C++ and Python alike on a 2-core machine
        # (the woken thread shares its core with pdlib's worker).
        while sender.poll() < pdlib.KVPoll.WaitingForInput:
            pass
        sender.init(pages, None)
        src = rng.permutation(pages).astype(np.int32)
        start = time.perf_counter()
        sender.send(src, True)
        times.append(time.perf_counter() - start)
        while not receiver.poll().is_terminal:
            pass
        sender.close()
        receiver.close()
    decode.close()
    prefill.close()
    times.sort()
    return {"send_1000_median_us": statistics.median(times) * 1e6,
            "send_1000_p90_us": times[int(0.9 * len(times))] * 1e6}


# --- the two-process transfer --------------------------------------------------------------


def transfer_options(mode: pdlib.Mode, a: Dict[str, Any], port: int, keep: List[Any]
                     ) -> pdlib.KVManagerOptions:
    backend_options = dict(a["backend_options"])
    o = pdlib.KVManagerOptions(mode=mode, backend="ucx", backend_options=backend_options)
    o.direction = (pdlib.TransferDirection.Pull if a.get("direction") == "pull"
                   else pdlib.TransferDirection.Push)
    buffers = 2 * a["layers"]
    buffer_bytes = a["pool_pages"] * a["item_bytes"]
    # One backend-allocated pool carved into the K and V buffers, as pdlib-transfer-bench's
    # default --pool-alloc backend does (UCX shm writes directly into such memory).
    pool = pdlib.allocate_kv_pool("ucx", buffers * buffer_bytes, pdlib.MemoryKind.Host,
                                  backend_options, mode)
    keep.append(pool)
    # Touch every page now, as pdlib-transfer-bench does: a pool is allocated lazily, and first
    # touches (page faults, zeroing) inside the measured transfers cost more than the copies.
    pool.view()[:] = 0x5a if mode == pdlib.Mode.Prefill else 0
    for b in range(buffers):
        o.args.kv.ptrs.append(pool.data_ptr + b * buffer_bytes)
        o.args.kv.lens.append(buffer_bytes)
        o.args.kv.item_lens.append(a["item_bytes"])
    aux = pdlib.MetadataBuffers(2 * a["concurrency"] + 4)
    keep.append(aux)
    o.args.aux = aux.describe()
    o.args.aux_room_buffer = -1  # the benchmark does not fill aux slots
    o.args.page_size = 16
    o.args.fingerprint = pdlib.ModelFingerprint(a["layers"], 8, 128, 2, 1, "bench")
    o.bootstrap_port = port
    o.start_bootstrap_server = mode == pdlib.Mode.Prefill
    return o


def run_prefill(a: Dict[str, Any]) -> int:
    """The prefill process: sends every room as soon as decode's pages are known (push), or as
    soon as its sender exists (pull: the pages are published for decode to read)."""
    keep: List[Any] = []
    manager = pdlib.KVManager.create(transfer_options(pdlib.Mode.Prefill, a, a["port"], keep))
    print("READY", flush=True)
    rng = random.Random(7)
    total = a["warmup"] + a["requests"]
    pending = list(range(1, total + 1))
    live: Dict[int, Any] = {}
    done = 0
    idle = Backoff()
    pull = a.get("direction") == "pull"
    while done < total:
        progressed = False
        while pending and len(live) < 2 * a["concurrency"]:
            room = pending.pop(0)
            live[room] = [manager.create_sender(room), False]
            progressed = True
        for room in list(live):
            sender, sent = live[room]
            state = sender.poll()
            if not sent and not state.is_terminal and (
                    pull or state == pdlib.KVPoll.WaitingForInput):
                pages = np.asarray(rng.sample(range(a["pool_pages"]), a["pages"]), np.int32)
                sender.init(a["pages"], None)
                sender.send(pages, True)
                live[room][1] = True
                progressed = True
            elif state.is_terminal:
                sender.close()
                del live[room]
                done += 1
                progressed = True
        idle.wait(progressed)
    sys.stdin.readline()  # decode says when it has read everything
    manager.close()
    return 0


def run_decode(a: Dict[str, Any]) -> Dict[str, float]:
    port = free_port()
    a = dict(a, port=port)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "prefill",
                              "--config", json.dumps(a)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "READY"
        keep: List[Any] = []
        manager = pdlib.KVManager.create(transfer_options(pdlib.Mode.Decode, a, port, keep))
        rng = random.Random(11)
        address = f"127.0.0.1:{port}"

        def batch(first: int, count: int) -> float:
            pending = list(range(first, first + count))
            live: Dict[int, Any] = {}
            start = time.perf_counter()
            idle = Backoff()
            while pending or live:
                progressed = False
                while pending and len(live) < a["concurrency"]:
                    room = pending.pop(0)
                    r = manager.create_receiver(address, room)
                    r.init(np.asarray(rng.sample(range(a["pool_pages"]), a["pages"]), np.int32),
                           None)
                    live[room] = r
                    progressed = True
                for room in list(live):
                    state = live[room].poll()
                    if state.is_terminal:
                        if state != pdlib.KVPoll.Success:
                            raise RuntimeError(f"room {room}: {live[room].failure_reason()}")
                        live[room].close()
                        del live[room]
                        progressed = True
                idle.wait(progressed)
            return time.perf_counter() - start

        batch(1, a["warmup"])
        seconds = batch(a["warmup"] + 1, a["requests"])
        manager.close()
    finally:
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(30)
        except Exception:  # noqa: BLE001 - the child is killed below anyway
            pass
        if child.poll() is None:
            child.kill()
    payload = a["requests"] * a["pages"] * 2 * a["layers"] * a["item_bytes"]
    return {"seconds": seconds, "gbytes_per_s": payload / seconds / 1e9}


def run_cxx_send(binary: str) -> Optional[float]:
    """BM_SendCall's median (us): the same Send() of 1,000 pages, called from C++."""
    cmd = [binary, "--benchmark_filter=BM_SendCall", "--benchmark_format=json",
           "--benchmark_min_time=0.5"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
        return float(json.loads(out)["benchmarks"][0]["median_us"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as e:
        print(f"pdlib_micro_bench failed: {e}", file=sys.stderr)
        return None


def run_cxx(binary: str, a: Dict[str, Any]) -> Optional[float]:
    cmd = [binary, "--backend", "ucx", "--layers", str(a["layers"]), "--item-bytes",
           str(a["item_bytes"]), "--pages", str(a["pages"]), "--layout", "scattered",
           "--pool-pages", str(a["pool_pages"]), "--requests", str(a["requests"]),
           "--warmup", str(a["warmup"]), "--concurrency", str(a["concurrency"]), "--json",
           "--direction", a.get("direction", "push")]
    for k, v in a["backend_options"].items():
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
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--cxx-bench", default=os.path.join(
        HERE, "..", "..", "build", "release", "bench", "transfer", "pdlib-transfer-bench"))
    ap.add_argument("--cxx-micro-bench", default=os.path.join(
        HERE, "..", "..", "build", "release", "bench", "pdlib_micro_bench"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="transfer runs per side; best kept")
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--json", default=None, help="also write the JSON object to this file")
    ap.add_argument("--direction", choices=["push", "pull", "both"], default="push",
                    help="transfer: push (prefill writes), pull (decode reads, issue #29), or "
                         "both (push, then pull, and pull / push)")
    args = ap.parse_args()
    if args.role == "prefill":
        return run_prefill(json.loads(args.config))

    results: Dict[str, Any] = {}
    results.update(bench_poll())
    results.update(bench_send())
    rows = [("poll() [pdlib]", f"{results['poll_us']:.3f} us", "<= 1 us",
             results["poll_us"] <= 1.0),
            ("poll() [pdlib.sglang]", f"{results['sglang_poll_us']:.3f} us", "<= 1 us",
             results["sglang_poll_us"] <= 1.0),
            ("send() 1000 pages, median", f"{results['send_1000_median_us']:.2f} us", "<= 20 us",
             results["send_1000_median_us"] <= 20.0)]
    cxx_send = (run_cxx_send(args.cxx_micro_bench) if os.path.exists(args.cxx_micro_bench)
                else None)
    results["send_1000_cxx_median_us"] = cxx_send
    rows.append(("Send() 1000 pages from C++, median",
                 f"{cxx_send:.2f} us" if cxx_send is not None else "n.a.", "baseline", None))
    directions = ["push", "pull"] if args.direction == "both" else [args.direction]
    if not args.skip_transfer and "ucx" in pdlib.list_backends():
        for name, opts in (("shm", {"ucx.tls": "shm"}),
                           ("tcp", {"ucx.tls": "tcp", "ucx.net_devices": "lo"})):
            best: Dict[str, float] = {}
            for direction in directions:
                # Keys and rows of push keep their names from before pull existed.
                key = name if direction == "push" else f"{name}_pull"
                label = name if direction == "push" else f"{name} pull"
                a = dict(layers=32, item_bytes=32768, pages=16, pool_pages=128,
                         requests=args.requests, warmup=args.warmup, concurrency=4,
                         backend_options=opts, direction=direction)
                # Interleaved, best of --repeat each: the two share one machine and its noise.
                py_runs, cxx_runs = [], []
                for _ in range(args.repeat):
                    py_runs.append(run_decode(a)["gbytes_per_s"])
                    cxx = run_cxx(args.cxx_bench, a) if os.path.exists(args.cxx_bench) else None
                    if cxx is not None:
                        cxx_runs.append(cxx)
                py = max(py_runs)
                best[direction] = py
                cxx = max(cxx_runs) if cxx_runs else None
                results[f"transfer_{key}_python_gbytes_per_s"] = py
                results[f"transfer_{key}_cxx_gbytes_per_s"] = cxx
                ratio = py / cxx if cxx else None
                results[f"transfer_{key}_ratio"] = ratio
                rows.append((f"transfer ucx {label} (Python / C++)",
                             f"{py:.2f} / {cxx:.2f} GB/s" if cxx else f"{py:.2f} GB/s / n.a.",
                             ">= 95%", None if ratio is None else ratio >= 0.95))
            if len(best) == 2:
                pull_push = best["pull"] / best["push"]
                results[f"transfer_{name}_pull_push_ratio"] = pull_push
                rows.append((f"transfer ucx {name} pull / push (Python)",
                             f"{best['pull']:.2f} / {best['push']:.2f} GB/s", ">= 90%",
                             pull_push >= 0.9))
    width = max(len(r[0]) for r in rows)
    print(f"{'benchmark':<{width}}  {'measured':>24}  {'target':>9}  ok")
    for name, value, target, ok in rows:
        print(f"{name:<{width}}  {value:>24}  {target:>9}  {'-' if ok is None else ok}")
    text = json.dumps(results, indent=None, sort_keys=True)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
