#!/usr/bin/env bash
# Builds the planner fuzzer with clang in build/fuzz and runs it for SECONDS (default 60).
#   fuzz/run.sh SECONDS
# Seeds: fuzz/corpus/planner (committed, never written). New inputs go to
# build/fuzz/corpus/planner; a crash leaves build/fuzz/crash-* and makes this script fail.
# Environment: CXX_FUZZ (default clang++), JOBS (build parallelism, default 2).
set -euo pipefail

seconds=${1:-60}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/fuzz
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

cmake -S "$root/fuzz" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER="${CXX_FUZZ:-clang++}" >/dev/null
cmake --build "$build" -j "${JOBS:-2}" --target planner_fuzz

work=$build/corpus/planner
mkdir -p "$work"
"$build/planner_fuzz" -max_total_time="$seconds" -max_len=512 -timeout=20 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$build/" "$work" "$root/fuzz/corpus/planner"
