#!/bin/bash
# rails.sh N [MBIT]: inside the Soft-RoCE VM (rxe_vm.sh), N rails whose two ends are different
# RDMA devices and whose rate can be capped (issue #31). Rail r is a veth pair va<r> (10.7.r.1)
# <-> vb<r> (10.7.r.2) with Soft-RoCE on each end: rxa<r> on va<r>, rxb<r> on vb<r>. A process on
# the rxa devices (prefill) and one on the rxb devices (decode) then talk over the veth wire, not
# over rxe's loopback (which skips the qdiscs): policy routes (for traffic this host sends:
# iif lo; arriving packets still find their address local) send 10.7.r.1 -> 10.7.r.2 out of
# va<r> and back out of vb<r>, the local table is looked up after them, and accept_local lets each
# end take packets from an address of its own host. With MBIT, a tbf on both ends caps the rail
# at MBIT Mbit/s each way. Prints the devices; exits non-zero when a step fails.
set -euo pipefail
n=${1:?usage: rails.sh N [MBIT]}
mbit=${2:-}
sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
if ip rule show | grep -q '^0:.*lookup local'; then
  ip rule add pref 1000 table local
  ip rule del pref 0
fi
for r in $(seq 0 $((n - 1))); do
  a=va$r b=vb$r ipa=10.7.$r.1 ipb=10.7.$r.2
  ip link add $a type veth peer name $b
  for d in $a $b; do
    sysctl -qw net.ipv4.conf.$d.accept_local=1 net.ipv4.conf.$d.rp_filter=0
  done
  ip addr add $ipa/32 dev $a
  ip addr add $ipb/32 dev $b
  ip link set $a up
  ip link set $b up
  ip rule add pref $((100 + 2 * r)) iif lo from $ipa to $ipb table $((10 + 2 * r))
  ip route add $ipb dev $a src $ipa table $((10 + 2 * r))
  ip rule add pref $((101 + 2 * r)) iif lo from $ipb to $ipa table $((11 + 2 * r))
  ip route add $ipa dev $b src $ipb table $((11 + 2 * r))
  if [ -n "$mbit" ]; then
    # 10 ms at the rate, at least a few frames, as tools/netns caps its links.
    burst=$((mbit * 1000000 / 8 / 100))
    [ $burst -ge 15000 ] || burst=15000
    for d in $a $b; do tc qdisc add dev $d root tbf rate ${mbit}mbit burst $burst latency 100ms; done
  fi
  rdma link add rxa$r type rxe netdev $a
  rdma link add rxb$r type rxe netdev $b
done
for r in $(seq 0 $((n - 1))); do
  for d in rxa$r rxb$r; do
    for _ in $(seq 50); do
      grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state 2>/dev/null && break
      sleep 0.1
    done
    grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state || { echo "rails.sh: $d not ACTIVE" >&2; exit 1; }
  done
done
echo "rails.sh: $n rails (rxa<r> on va<r> 10.7.<r>.1 <-> rxb<r> on vb<r> 10.7.<r>.2)${mbit:+, each capped at $mbit Mbit/s}"
