"""Starts the example pair on 127.0.0.1 - prefill.py (TP 1) and decode.py as 2 TP ranks - and
exits 0 when every request arrived with every byte right.

    PYTHONPATH=<build>/python python3 examples/python/run_pair.py [--tls shm|tcp] [--requests N]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    """True once something accepts on 127.0.0.1:port; False if proc exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tls", default="shm")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--timeout", type=float, default=180)
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    bootstrap, dist_port = free_port(), free_port()
    common = ["--bootstrap-port", str(bootstrap), "--requests", str(a.requests), "--tls", a.tls]
    if a.backend:
        common += ["--backend", a.backend]
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "prefill.py")] + common)]
    # As in a deployment, decode starts once prefill's bootstrap server is up (importing torch
    # alone takes seconds on a busy machine: longer than a receiver's bootstrap timeout).
    if not wait_for_port(bootstrap, procs[0], a.timeout):
        procs[0].kill()
        print(f"run_pair: FAILED (prefill's bootstrap server never came up on port {bootstrap})")
        return 1
    procs += [subprocess.Popen([sys.executable, os.path.join(here, "decode.py"), "--rank",
                                str(r), "--world", "2", "--dist-port", str(dist_port)] + common)
              for r in range(2)]
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(a.timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print("run_pair:", "OK" if codes == [0, 0, 0] else f"FAILED (exit codes {codes})")
    return 0 if codes == [0, 0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
