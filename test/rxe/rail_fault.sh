#!/bin/bash
# rail_fault.sh [AT_MB [FOR_S [BENCH_ARGS...]]]: inside the Soft-RoCE VM (rxe_vm.sh), the verbs
# backend striped over PDLIB_RAILS capped rails (rails.sh; 2 by default, each PDLIB_RAIL_MBIT=100) while the
# last rail's wire (va<PDLIB_RAILS-1>) goes down once it carried AT_MB MB (default 4) and comes back
# FOR_S s later (default 3), every byte checked (--verify, --failures_ok). Prints the bench's JSON
# row (succeeded, failed, first_failure, wrong_bytes). What it shows (issue #31):
#   PDLIB_RAILS=2: the rail fails alone - its QP errors ('local QP operation error') or stalls (neither
#     completes nor fails: Soft-RoCE after a link flap; verbs.rail_stall_ms fails it), the one
#     request with bytes on it fails naming the device, the others go on over rail 0.
#   PDLIB_RAILS=1: the connection's only rail fails, so the connection does; prefill replaces it although
#     the control stream (127.0.0.1) stays up, requests fail while the port is down ("no rail to
#     connect over: verbs: port rxa0:1 is DOWN") and succeed again after the heal.
#   test/rxe/rxe_vm.sh --share "$PWD" --timeout 300 -- test/rxe/rail_fault.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench=${PDLIB_BENCH:-$here/../../build/release/bench/transfer/pdlib-transfer-bench}
at_mb=${1:-4}
for_s=${2:-3}
rails=${PDLIB_RAILS:-2}
cut=$((rails - 1))
"$here/rails.sh" "$rails" "${PDLIB_RAIL_MBIT:-100}"
prefill_nics=$(seq -s, -f 'rxa%g' 0 "$cut")
decode_nics=$(seq -s, -f 'rxb%g' 0 "$cut")
(
  # Once requests run on every rail (the last one carried AT_MB MB), its wire goes down.
  for _ in $(seq 1200); do
    [ "$(cat /sys/class/net/va$cut/statistics/tx_bytes)" -lt $((at_mb * 1000000)) ] || break
    sleep 0.1
  done
  ip link set "va$cut" down
  echo "rail_fault.sh: va$cut (rxa$cut <-> rxb$cut) down after ${at_mb} MB on it" >&2
  sleep "$for_s"
  ip link set "va$cut" up
  # A device going down takes its routes with it: rails.sh's policy routes come back here.
  ip route replace "10.7.$cut.2" dev "va$cut" src "10.7.$cut.1" table $((10 + 2 * cut))
  ip route replace "10.7.$cut.1" dev "vb$cut" src "10.7.$cut.2" table $((11 + 2 * cut))
  echo "rail_fault.sh: va$cut up again after ${for_s} s" >&2
) &
"$bench" --backend verbs --prefill-nic-names "$prefill_nics" --decode-nic-names "$decode_nics" \
  --layers 4 --item-bytes 16384 --pages 8 --layout scattered \
  --requests 400 --warmup 2 --concurrency 1 --pool-bytes 16m --progress-every 5 --verify \
  --failures_ok --json "${@:3}"
wait
# Soft-RoCE's own counters of every rail (retransmissions, sequence errors).
for dev in $(seq -f "rxa%g" 0 "$cut") $(seq -f "rxb%g" 0 "$cut"); do
  counters=/sys/class/infiniband/$dev/ports/1/hw_counters
  [ -d "$counters" ] || continue
  echo "rail_fault.sh: $dev:" $(for f in "$counters"/*; do
    v=$(cat "$f" 2>/dev/null || echo ?)
    [ "$v" = 0 ] || printf '%s=%s ' "$(basename "$f")" "$v"
  done) >&2
done
