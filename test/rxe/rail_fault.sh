#!/bin/bash
# rail_fault.sh [AT_MB [FOR_S [BENCH_ARGS...]]]: inside the Soft-RoCE VM (rxe_vm.sh), the verbs
# backend striped over two capped rails (rails.sh) while rail 1's wire (va1) goes down once it
# carried AT_MB MB (default 4) and comes back FOR_S s later (default 3), every byte checked
# (--verify, --failures_ok). A diagnostic for issue #31, not a ctest: what it shows today is
# that a verbs rail failure fails the whole connection (the reason names the device: "over
# rxa1:1 ... 'local QP operation error'"), that prefill then refuses the following requests to
# that decode with the same reason ("posting KV writes: ...", ~7 ms each) because the core
# replaces a transport connection only when the decode session registers again and the control
# stream (on 127.0.0.1) never broke, and that after the heal requests sometimes crawl (6 of 1500
# done in 60 s with `2 1 --requests 1500`; cause not found). Prints the bench's JSON row.
#   test/rxe/rxe_vm.sh --share "$PWD" --timeout 300 -- test/rxe/rail_fault.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench=${PDLIB_BENCH:-$here/../../build/release/bench/transfer/pdlib-transfer-bench}
at_mb=${1:-4}
for_s=${2:-3}
"$here/rails.sh" 2 100
(
  # Once requests run on both rails (rail 1 carried AT_MB MB), rail 1's wire goes down.
  for _ in $(seq 1200); do
    [ "$(cat /sys/class/net/va1/statistics/tx_bytes)" -lt $((at_mb * 1000000)) ] || break
    sleep 0.1
  done
  ip link set va1 down
  echo "rail_fault.sh: va1 (rxa1 <-> rxb1) down after ${at_mb} MB on it" >&2
  sleep "$for_s"
  ip link set va1 up
  # A device going down takes its routes with it: rails.sh's policy routes come back here.
  ip route replace 10.7.1.2 dev va1 src 10.7.1.1 table 12
  ip route replace 10.7.1.1 dev vb1 src 10.7.1.2 table 13
  echo "rail_fault.sh: va1 up again after ${for_s} s" >&2
) &
"$bench" --backend verbs --prefill-nic-names rxa0,rxa1 --decode-nic-names rxb0,rxb1 \
  --layers 4 --item-bytes 16384 --pages 8 --layout scattered \
  --requests 400 --warmup 2 --concurrency 1 --pool-bytes 16m --progress-every 0 --verify \
  --failures_ok --json "${@:3}"
wait
