#!/usr/bin/env bash
# scripts/gpu-check.sh: the GPU checks and measurements of issue #19 in one command, for a machine
# with an NVIDIA GPU (docs/DEVELOPERS.md, "Running the GPU checks"). Run from the repository root:
#
#   scripts/gpu-check.sh                  # build what it runs (build/release), then every step
#   scripts/gpu-check.sh --no-build       # the build is already there
#   scripts/gpu-check.sh --build-only     # only build what it runs (scripts/gpu-bundle.sh pack)
#   scripts/gpu-check.sh --out DIR        # where the logs go (default: $OUT, else ./gpu-check-out)
#
# Steps (each under its own timeout, about 8.5 minutes together at worst on an H100 after the
# build; a failed step does not stop the others):
#   cuda_info      nvidia-smi -L and pdlib_cuda_info (kernels::ProbeCuda())
#   kernel_cuda    ctest -R kernel_cuda: the CUDA model against the CPU model
#   cuda_ipc       ctest -R 'cuda_ipc|copy_plan|gather_copy|digest_*': the cuda_ipc backend's tests
#                  and the GPU digest kernel's, the
#                  two-process planner scenarios over GPU pools (TP 2->1 HND/NHD, MLA, PP 2, mamba
#                  state, a negative control, layer-wise) and the transfer bench's GPU byte check
#                  (transfer_bench_cuda_ipc_verify); fails if any GPU case printed SKIP
#   hosts_cuda     ctest -R 'hosts engine: device cuda': prefill and decode hosts on the CUDA model,
#                  GPU KV pools over cuda_ipc, tokens against the CPU reference
#   conformance    the backend conformance suite with PDLIB_CONFORMANCE_BACKENDS=cuda_ipc, over
#                  host and GPU regions (fails if the GPU case skipped)
#   transfer       pdlib-transfer-bench, two processes, GPU pools over cuda_ipc: 32 layers x K,V x
#                  32 KiB items, 16 scattered pages, next to cudaMemcpy D2D of the same writes
#   transfer_ratio the issue's figure from that run: cuda_ipc / cudaMemcpy D2D >= 0.70
#   relayout       pdlib_relayout_bench, when this build has it
#   digest         pdlib_digest_bench: the GPU KV digest (issue #42) next to cudaMemcpy D2D
#   transfer_checksum  the transfer bench over GPU pools with --checksum off,sampled,all
#   kernel_bench   pdlib_kernel_bench's CUDA cases: decode tokens/s and decode attention GB/s vs
#                  the GPU's peak
#   demo           pd-demo --device cuda, 16 requests, 16/16 identical to the CPU colocated run;
#                  when not, demo_gpu_ref repeats it with the reference on the GPU (tells a
#                  transfer fault from a CUDA-vs-CPU near-tie)
#
# Each step's output is in <out>/<NN>-<step>.log; <out>/summary.txt has one line per step and
# the figures. Exit status: 0 when every step passed, 1 otherwise, 2 on a bad command line.
set -u -o pipefail

build=1
build_only=0
out="${OUT:-}"
build_dir=build/release
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    --build-only) build_only=1 ;;
    --out) out="$2"; shift ;;
    --out=*) out="${1#--out=}" ;;
    --build-dir) build_dir="$2"; shift ;;
    --build-dir=*) build_dir="${1#--build-dir=}" ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || out=gpu-check-out
if [ ! -f CMakePresets.json ] || [ ! -d scripts ]; then
  echo "gpu-check: run from the repository root" >&2
  exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
: > "$summary"
failed=0
step_no=0

note() { echo "$*" | tee -a "$summary"; }

# run_step NAME SECONDS COMMAND...: runs COMMAND under a timeout, output to <out>/NN-NAME.log
# (and the terminal), records PASS/FAIL/TIMEOUT with the time taken.
run_step() {
  local name="$1" limit="$2"
  shift 2
  step_no=$((step_no + 1))
  local log
  log="$out/$(printf '%02d' "$step_no")-$name.log"
  echo "=== $name (limit ${limit}s): $*" | tee "$log"
  local start=$SECONDS rc
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) verdict=PASS
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMEOUT"
  elif [ "$rc" -ne 0 ]; then
    verdict="FAIL(rc=$rc)"
  fi
  [ "$verdict" = PASS ] || failed=1
  printf '%-15s %-12s %4ss  %s\n' "$name" "$verdict" "$took" "$(basename "$log")" >> "$summary"
  return "$rc"
}

# expect_absent PATTERN WHY: fails the step just run when its log matches PATTERN (a GPU case
# that skipped or errored while the exit status said fine).
expect_absent() {
  local log
  log="$(ls "$out"/"$(printf '%02d' "$step_no")"-*.log)"
  if grep -q -E "$1" "$log"; then
    failed=1
    printf '%-15s %-12s       %s\n' "" "FAIL" "$2 ('$1' in $(basename "$log"))" >> "$summary"
  fi
}

# --- build (not part of the time budget) ---
if [ "$build" -eq 1 ]; then
  if [ ! -f "$build_dir/build.ninja" ]; then
    # Refuse to go on without CUDA rather than measure nothing.
    cmake --preset release -DPDLIB_WITH_CUDA=ON > "$out/00-configure.log" 2>&1 || {
      cat "$out/00-configure.log"
      echo "gpu-check: configure failed (log: $out/00-configure.log)" >&2
      exit 1
    }
  fi
  # Only what the steps run; test targets are found by name (the cuda_ipc tests may be several).
  targets="pd-demo pd-prefill pd-decode pd-router pdlib-bootstrap pdlib-transfer-bench"
  targets="$targets pdlib_kernel_bench pdlib_cuda_info backend_conformance_test hosts_engine_test"
  targets="$targets planner_e2e_test pdlib_planner_peer"
  targets="$targets $(ninja -C "$build_dir" -t targets all 2>/dev/null |
    sed -n 's/^\(kernel_cuda[a-z_]*_test\|cuda_ipc[a-z_]*_test\|copy_plan[a-z_]*_test\|gather_copy[a-z_]*_test\|digest_[a-z_]*_test\|pdlib_relayout_bench\|pdlib_digest_bench\): phony$/\1/p' |
    sort -u | tr '\n' ' ')"
  echo "gpu-check: building $targets"
  # shellcheck disable=SC2086
  cmake --build "$build_dir" -j "$(nproc)" --target $targets > "$out/00-build.log" 2>&1 || {
    tail -40 "$out/00-build.log"
    echo "gpu-check: build failed (log: $out/00-build.log)" >&2
    exit 1
  }
fi
if [ "$build_only" -eq 1 ]; then
  echo "gpu-check: built (log: $out/00-build.log)"
  exit 0
fi
bin() { echo "$build_dir/$1"; }
[ -x "$(bin bench/kernels/pdlib_cuda_info)" ] || {
  echo "gpu-check: $(bin bench/kernels/pdlib_cuda_info) is missing: build first (or drop --no-build)" >&2
  exit 1
}

# The commit the executables were built from: a bundle's (scripts/gpu-bundle.sh) records it, and the
# checkout it runs in may be another commit.
commit="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
[ -f "$build_dir/.gpu-lib/COMMIT" ] && commit="$(cut -c1-7 "$build_dir/.gpu-lib/COMMIT") (bundle)"
note "gpu-check: $(date -u +%FT%TZ) on $(hostname), commit $commit; logs in $out"

# --- 1. what the machine has ---
if ! run_step cuda_info 30 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $(bin bench/kernels/pdlib_cuda_info)"; then
  # Every later step needs the GPU: say why there is none and stop.
  note "gpu-check: no usable CUDA device (see $out/01-cuda_info.log): nothing else can run"
  cat "$summary"
  exit 1
fi

# --- 2-4. tests ---
ctest_step() {  # NAME SECONDS REGEX [ENV=VALUE or ctest flag...]
  local name="$1" limit="$2" regex="$3"
  shift 3
  local envs=() flags=()
  for a in "$@"; do
    case "$a" in
      -*) flags+=("$a") ;;
      *) envs+=("$a") ;;
    esac
  done
  run_step "$name" "$limit" env "${envs[@]}" ctest --test-dir "$build_dir" -R "$regex" \
    --output-on-failure --no-tests=error --timeout $((limit - 5)) "${flags[@]}"
}
ctest_step kernel_cuda 50 'kernel_cuda' -V
expect_absent 'skipped: no CUDA device' "a CUDA case skipped although the GPU is there"
ctest_step cuda_ipc 90 'cuda_ipc|copy_plan|gather_copy|digest_math|digest_kernel' -j4 -V
expect_absent 'SKIP' "a cuda_ipc GPU case skipped although the GPU is there"
ctest_step hosts_cuda 50 'hosts engine: device cuda' -V
expect_absent 'skipped: no CUDA device' "the GPU hosts case skipped although the GPU is there"
# Only the plain registration: the ucx ones set PDLIB_CONFORMANCE_BACKENDS=ucx themselves (Debian's
# UCX has no CUDA support, so their GPU case rightly skips).
ctest_step conformance 45 '^backend_conformance_test:backend conformance$' PDLIB_CONFORMANCE_BACKENDS=cuda_ipc -V
expect_absent 'backend cuda_ipc with cuda memory skipped' "the conformance suite skipped GPU memory"

# --- 5. the transfer bench: GPU pools, two processes over cuda_ipc, next to cudaMemcpy D2D ---
transfer_json="$out/transfer.jsonl"
run_step transfer 90 bash -c "set -o pipefail; $(bin bench/transfer/pdlib-transfer-bench) \
  --memory cuda --backend cuda_ipc --layers 32 --item-bytes 32768 --pages 16 --layout scattered \
  --concurrency 1,4,16 --requests 1000 --warmup 50 --pool-bytes 1g --progress-every 0 \
  --baseline memcpy --json | tee '$transfer_json'"
# The figure: the best concurrency's ratio against the 0.70 target.
run_step transfer_ratio 10 python3 - "$transfer_json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not rows:
    sys.exit("no result rows (see the transfer step's log)")
for r in rows:
    print("concurrency %3d: cuda_ipc %8.2f GB/s, %s %8.2f GB/s, ratio %s, p50 %s us, error %s"
          % (r["concurrency"], r["gbytes_per_s"], r.get("baseline"),
             r.get("baseline_gbytes_per_s") or 0, r.get("ratio"), r["p50_us"], r["error"]))
ratios = [r["ratio"] for r in rows if r.get("ratio") is not None and r["error"] is None]
if not ratios:
    sys.exit("no ratio: every configuration failed or had no baseline")
best = max(ratios)
print("best cuda_ipc / cudaMemcpy D2D = %.3f (issue #19 target >= 0.70): %s"
      % (best, "met" if best >= 0.70 else "NOT met"))
sys.exit(0 if best >= 0.70 else 1)
PY

# --- 6. the re-layout bench, where this build has one ---
relayout="$(find "$build_dir/bench" -name pdlib_relayout_bench -type f -perm -u+x 2>/dev/null | head -1)"
if [ -n "$relayout" ]; then
  run_step relayout 30 "$relayout"
else
  printf '%-15s %-12s\n' relayout "SKIPPED (no pdlib_relayout_bench in this build)" >> "$summary"
fi

# --- 6b. the KV digest on the GPU (issue #42): the kernel's rate next to cudaMemcpy D2D, then
# the transfer bench's GPU pools with checksums off, sampled and all ---
digest_bench="$(find "$build_dir/bench" -name pdlib_digest_bench -type f -perm -u+x 2>/dev/null | head -1)"
if [ -n "$digest_bench" ]; then
  run_step digest 30 "$digest_bench"
  expect_absent 'SKIP' "the digest bench skipped although the GPU is there"
else
  printf '%-15s %-12s\n' digest "SKIPPED (no pdlib_digest_bench in this build)" >> "$summary"
fi
run_step transfer_checksum 60 "$(bin bench/transfer/pdlib-transfer-bench)" \
  --memory cuda --backend cuda_ipc --layers 32 --item-bytes 32768 --pages 16 --layout scattered \
  --concurrency 4 --requests 300 --warmup 30 --pool-bytes 1g --progress-every 0 \
  --checksum off,sampled,all --checksum-sample-every 8

# --- 7. the kernels: CUDA decode throughput and decode-attention bandwidth against HBM ---
run_step kernel_bench 50 "$(bin bench/kernels/pdlib_kernel_bench)" \
  --benchmark_filter='Cuda' --benchmark_counters_tabular=true
expect_absent 'ERROR OCCURRED' "a CUDA benchmark did not run"

# --- 8. the example deployment on the GPU ---
demo_check() {  # LOG: passes when the run printed 16/16 identical
  grep -q '^16/16 outputs identical to the colocated run' "$1"
}
run_step demo 90 bash -c "$(bin examples/demo/pd-demo) --device cuda --requests 16 \
  --log-dir '$out/demo-logs'"
demo_log="$out/$(printf '%02d' "$step_no")-demo.log"
if demo_check "$demo_log"; then
  note "demo: 16/16 identical to the CPU colocated run"
else
  note "demo: NOT 16/16 identical to the CPU colocated run; repeating with the reference on the GPU"
  run_step demo_gpu_ref 60 bash -c "$(bin examples/demo/pd-demo) --device cuda \
    --reference-device cuda --requests 16 --log-dir '$out/demo-gpu-ref-logs'"
fi

# --- summary ---
{
  echo
  echo "figures:"
  grep -h -E 'best cuda_ipc|concurrency +[0-9]+:' "$out"/*-transfer_ratio.log 2>/dev/null
  grep -h -E 'BM_CudaDecodeAttention|BM_CudaDecode/' "$out"/*-kernel_bench.log 2>/dev/null
  grep -h -E 'outputs identical' "$out"/*-demo*.log 2>/dev/null
} >> "$summary"
echo
echo "===== gpu-check summary ($summary)"
cat "$summary"
if [ "$failed" -ne 0 ]; then
  echo "gpu-check: FAILED (see the logs above)"
  exit 1
fi
echo "gpu-check: every step passed"
exit 0
