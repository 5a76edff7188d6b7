"""A prefill server in its own process for the kill test of test_sglang.py:

    python3 sglang_prefill_proc.py '<json config>'

Runs the SGLang prefill scheduler replay (sglang_sched.PrefillInstance) for the configured
requests, holding every one in the waiting queue (never forwarded, never sent), prints
"READY" once its managers exist and "WAITING <n>" whenever the number of requests past the
bootstrap queue changes, and runs until it is killed (or max_seconds pass).

Config keys: model (sglang_sched.Model fields), port (bootstrap), model_path, tp, rooms
([room, input_len] pairs), max_seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_sched import Model, PrefillInstance, Spec, server_args  # noqa: E402


def main() -> int:
    cfg = json.loads(sys.argv[1])
    model = Model(**cfg["model"])
    sa = server_args(tp_size=cfg.get("tp", 1), disaggregation_bootstrap_port=cfg["port"],
                     model_path=cfg.get("model_path"))
    inst = PrefillInstance(model, sa, tp=cfg.get("tp", 1))
    inst.start()
    print("READY", flush=True)
    for room, input_len in cfg["rooms"]:
        inst.submit(Spec(room=room, input_len=input_len, hold_forever=True))
    deadline = time.monotonic() + cfg.get("max_seconds", 60)
    last = -1
    while time.monotonic() < deadline:
        waiting = len(inst.scheds[0].waiting_queue)
        if waiting != last:
            print(f"WAITING {waiting}", flush=True)
            last = waiting
        if inst.errors:
            print("ERROR " + inst.errors[0].replace("\n", " | "), flush=True)
            return 1
        time.sleep(0.01)
    return 3


if __name__ == "__main__":
    sys.exit(main())
