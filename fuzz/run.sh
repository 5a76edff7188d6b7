#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build/fuzz and runs each for SECONDS (default 60):
#   fuzz/run.sh SECONDS [TARGET...]      (targets: planner control; default: both)
#   planner: the transfer planner (planner_fuzz.cc)
#   control: hostile decode messages against the prefill protocol core (control_fuzz.cc)
# Seeds: fuzz/corpus/<target> (committed, never written; crashes found and fixed stay there as
# regression inputs). New inputs go to build/fuzz/corpus/<target>; a crash leaves
# build/fuzz/crash-* and makes this script fail. Each target's full log is
# build/fuzz/<target>.log; the last lines printed are one summary per target.
# Environment: CXX_FUZZ (default clang++), JOBS (build parallelism, default 2).
set -euo pipefail

seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(planner control); fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/fuzz
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

cmake -S "$root/fuzz" -B "$build" "${generator[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="${CXX_FUZZ:-clang++}" >/dev/null
for t in "${targets[@]}"; do
  cmake --build "$build" -j "${JOBS:-2}" --target "${t}_fuzz"
done

summaries=()
for t in "${targets[@]}"; do
  case $t in
    planner) max_len=512 ;;
    control) max_len=1024 ;;
    *) echo "fuzz/run.sh: unknown target '$t' (planner, control)" >&2; exit 2 ;;
  esac
  work=$build/corpus/$t
  log=$build/$t.log
  mkdir -p "$work"
  echo "fuzz: ${t}_fuzz for $seconds s (log: $log)"
  rc=0
  "$build/${t}_fuzz" -max_total_time="$seconds" -max_len="$max_len" -timeout=20 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/" \
    "$work" "$root/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    tail -n 60 "$log"
    echo "fuzz: ${t}_fuzz FAILED (exit $rc); the crashing input is in $build/" >&2
    exit $rc
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  corpus=$(grep -o 'corp: [0-9]*' "$log" | tail -n 1)
  extra=$(grep "^${t}_fuzz: " "$log" | tail -n 1 || true)
  summaries+=("fuzz: ${t}_fuzz ok: $execs execs ($rate/s), $cov, $corpus inputs${extra:+; ${extra#*: }}")
done
printf '%s\n' "${summaries[@]}"
