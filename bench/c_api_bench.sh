#!/bin/bash
# The C API against the C++ API, alternating runs of the two programs of bench/c_api_bench.cc
# (the machine is noisy: each figure is the median of ROUNDS runs), then a table and one JSON
# line.   bench/c_api_bench.sh [BUILD_DIR (build/release)] [ROUNDS (3)]
set -euo pipefail
build=${1:-build/release}
rounds=${2:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq "$rounds"); do
  for api in cxx c; do
    "$build/bench/pdlib_${api}_api_bench" --benchmark_format=json > "$tmp/$api.$r.json"
  done
done
/usr/bin/python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
fig = {}
for api in ("cxx", "c"):
    for r in range(1, rounds + 1):
        for b in json.load(open(f"{tmp}/{api}.{r}.json"))["benchmarks"]:
            kind = "poll" if "Poll" in b["name"] else "round_trip"
            fig.setdefault((kind, api), []).append(b["real_time"] * {"ns": 1, "us": 1e3, "ms": 1e6}[b["time_unit"]])
print(f"{'figure':<28}{'C++ API':>14}{'C API':>14}{'C / C++':>10}")
out = {}
for kind, unit, scale in (("poll", "ns", 1), ("round_trip", "us", 1e3)):
    cxx = statistics.median(fig[(kind, "cxx")]) / scale
    c = statistics.median(fig[(kind, "c")]) / scale
    print(f"{kind + ' (' + unit + ', median)':<28}{cxx:>14.2f}{c:>14.2f}{c / cxx:>10.3f}")
    out[kind] = {"cxx_" + unit: round(cxx, 3), "c_" + unit: round(c, 3), "ratio": round(c / cxx, 4)}
print(json.dumps({"bench": "c_api", "rounds": rounds, **out}))
PY
