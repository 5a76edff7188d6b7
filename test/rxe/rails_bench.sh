#!/bin/bash
# rails_bench.sh N MBIT [BENCH_ARGS...]: the verbs backend striped over 1 .. N Soft-RoCE rails
# capped at MBIT Mbit/s each (rails.sh), measured with pdlib-transfer-bench in the same run
# (issue #31: two rails >= 1.8x one, three >= 2.6x). Runs inside the VM:
#   test/rxe/rxe_vm.sh --share "$PWD" --timeout 900 -- test/rxe/rails_bench.sh 3 40
# The bench (build/release unless PDLIB_BENCH points elsewhere) runs prefill on rxa0..rxa<n-1>
# and decode on rxb0..rxb<n-1> (--prefill-nic-names / --decode-nic-names), so every byte crosses
# the capped veth wires. The VM's CPUs are emulated: keep MBIT x N well below what one rail does
# uncapped (a few hundred Mbit/s), so that the caps, not the CPUs, bound the rate. Prints one
# row per rail count, the ratios to one rail, and a JSON line.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
n=${1:?usage: rails_bench.sh N MBIT [BENCH_ARGS...]}
mbit=${2:?usage: rails_bench.sh N MBIT [BENCH_ARGS...]}
shift 2
bench=${PDLIB_BENCH:-$here/../../build/release/bench/transfer/pdlib-transfer-bench}
"$here/rails.sh" "$n" "$mbit"
declare -a gbps
for k in $(seq 1 "$n"); do
  p="" d=""
  for r in $(seq 0 $((k - 1))); do
    p+="${p:+,}rxa$r"
    d+="${d:+,}rxb$r"
  done
  out=$("$bench" --backend verbs --prefill-nic-names "$p" --decode-nic-names "$d" --layers 4 \
    --item-bytes 16384 --pages 8 --layout scattered --requests 40 --warmup 4 --concurrency 4 \
    --pool-bytes 16m --progress-every 0 --json "$@" 2>&1) || {
    echo "$out" >&2
    echo "rails_bench.sh: the bench failed on $k rails" >&2
    exit 1
  }
  g=$(echo "$out" | sed -n 's/.*"gbps":\([0-9.]*\).*/\1/p' | head -1)
  [ -n "$g" ] || { echo "$out" >&2; echo "rails_bench.sh: no gbps in the bench's JSON" >&2; exit 1; }
  gbps[$k]=$g
  printf 'verbs over %d rails (%s -> %s), each capped at %s Mbit/s: %s Gbit/s\n' "$k" "$p" "$d" "$mbit" "$g"
done
json="{\"rails_mbit\":$mbit"
for k in $(seq 1 "$n"); do
  ratio=$(awk -v a="${gbps[$k]}" -v b="${gbps[1]}" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')
  [ "$k" = 1 ] || printf '%d rails vs 1 (this run): %s / %s = %s\n' "$k" "${gbps[$k]}" "${gbps[1]}" "$ratio"
  json+=",\"gbps_$k\":${gbps[$k]},\"ratio_$k\":$ratio"
done
echo "$json}"
