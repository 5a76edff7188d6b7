#!/usr/bin/env bash
# rxe_vm_smoke, run inside the VM: rxe0 is up, an RC QP moves data through it (ibv_rc_pingpong -c
# checks every byte it receives), then exits 42 so that the test also sees the harness pass the
# exit status through.
set -euo pipefail
ibv_devinfo -d rxe0 | grep -E 'transport|state|active_mtu'
timeout 30 ibv_rc_pingpong -d rxe0 -g 1 -n 200 -s 4096 -c > /tmp/server.log 2>&1 &
server=$!
# Under emulation the server can take a second to listen: retry the client.
for _ in $(seq 40); do
  sleep 0.25
  if timeout 30 ibv_rc_pingpong -d rxe0 -g 1 -n 200 -s 4096 -c 127.0.0.1 > /tmp/client.log 2>&1; then
    break
  fi
done
cat /tmp/client.log
wait $server
grep -q '^1638400 bytes' /tmp/client.log  # 200 round trips of 4096 bytes each way, all checked
exit 42
