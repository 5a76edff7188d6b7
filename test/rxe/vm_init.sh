#!/bin/sh
# PID 1 of the Soft-RoCE test VM (busybox sh, from the initramfs that rxe_vm.sh builds).
#
# The host hands over everything through 9p shares: "usr" and "etc" (the host's, read-only),
# "ctl" (this run's control folder) and s0, s1, ... (host folders listed in /ctl/shares as
# "<tag> <absolute path> <ro|rw>", mounted at the same path). The VM builds a root from them,
# brings up rxe0 (Soft-RoCE on a dummy netdev), runs /ctl/cmd.sh in it, and writes:
#   /ctl/device   one line describing the RDMA device the command ran on
#   /ctl/out      the command's stdout and stderr
#   /ctl/rc       its exit status (125 when the VM could not set itself up; /ctl/error says why)
# then powers off. Nothing here waits without a bound: the host kills qemu at its deadline.
PATH=/bin
export PATH
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

R=/newroot
OPTS=trans=virtio,version=9p2000.L,msize=262144
mkdir -p $R
mount -t tmpfs -o size=1g,mode=0755 root $R
mkdir -p $R/usr $R/etc $R/ctl $R/proc $R/sys $R/dev $R/tmp $R/run $R/root
chmod 1777 $R/tmp
for d in bin sbin lib lib32 lib64 libx32; do ln -s usr/$d $R/$d; done

# Modules first (9p is one of them); a failure is reported once the control share is up.
insmod_errors=""
for m in $(cat /modules/order); do
  insmod "/modules/$m" || insmod_errors="$insmod_errors $m"
done
if ! mount -t 9p -o $OPTS ctl $R/ctl; then
  echo "rxe-vm-init: cannot mount the control share" >&2
  poweroff -f
fi
fail() {
  echo "$*" > $R/ctl/error
  echo 125 > $R/ctl/rc
  sync
  poweroff -f
}

[ -z "$insmod_errors" ] || fail "insmod failed for:$insmod_errors"
mount -t 9p -o $OPTS,ro,cache=loose usr $R/usr || fail "9p mount of the host /usr failed"
mount -t 9p -o $OPTS,ro,cache=loose etc $R/etc || fail "9p mount of the host /etc failed"
while read -r tag path mode; do
  [ -n "$tag" ] || continue
  mkdir -p "$R$path" || fail "mkdir $path failed"
  if [ "$mode" = rw ]; then
    mount -t 9p -o $OPTS "$tag" "$R$path" || fail "9p mount of $path failed"
  else
    mount -t 9p -o $OPTS,ro,cache=loose "$tag" "$R$path" || fail "9p mount of $path failed"
  fi
done < $R/ctl/shares
mount --bind /proc $R/proc
mount --bind /sys $R/sys
mount --bind /dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs -o mode=1777 shm $R/dev/shm

# Soft-RoCE needs an Ethernet netdev with an IPv4 address (RoCE v2 GID index 1 maps it).
# Processes of one VM talk through rxe's loopback path, so a dummy netdev is enough and no
# network leaves the VM.
ip link set lo up
# dummy.ko makes dummy0 itself (numdummies=1); create it only where it did not.
[ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy || fail "ip link add dummy0 failed"
ip addr add 192.168.77.1/24 dev dummy0
ip link set dummy0 up
chroot $R /usr/bin/rdma link add rxe0 type rxe netdev dummy0 || fail "rdma link add rxe0 failed"
state=""
for _ in $(seq 50); do
  state=$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)
  case "$state" in *ACTIVE*) break ;; esac
  sleep 0.1
done
case "$state" in *ACTIVE*) ;; *) fail "rxe0 port 1 is not ACTIVE (state '$state')" ;; esac
state0=$state
# Two more devices, each on a dummy netdev of its own (rails, issue #31): rxe1 on dummy1
# (192.168.78.1), rxe2 on dummy2 (192.168.79.1). rxe0 stays the first device.
for i in 1 2; do
  ip link add dummy$i type dummy || fail "ip link add dummy$i failed"
  ip addr add 192.168.$((77 + i)).1/24 dev dummy$i
  ip link set dummy$i up
  chroot $R /usr/bin/rdma link add rxe$i type rxe netdev dummy$i || fail "rdma link add rxe$i failed"
done
for i in 1 2; do
  state=""
  for _ in $(seq 50); do
    state=$(cat /sys/class/infiniband/rxe$i/ports/1/state 2>/dev/null)
    case "$state" in *ACTIVE*) break ;; esac
    sleep 0.1
  done
  case "$state" in *ACTIVE*) ;; *) fail "rxe$i port 1 is not ACTIVE (state '$state')" ;; esac
done
mtu=$(chroot $R /usr/bin/ibv_devinfo -d rxe0 2>/dev/null | sed -n 's/.*active_mtu:[[:space:]]*\([0-9]*\).*/\1/p')
echo "rxe0 (rdma_rxe, kernel $(uname -r), netdev dummy0 192.168.77.1, port 1 ${state0#*: }, active MTU ${mtu:-?}; also rxe1, rxe2)" > $R/ctl/device

echo "rxe-vm-init: ready after $(cut -d' ' -f1 /proc/uptime) s"
chroot $R /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/usr/sbin HOME=/root TMPDIR=/tmp \
  TERM=dumb RXE_IP=192.168.77.1 /bin/bash /ctl/cmd.sh > $R/ctl/out 2>&1
echo $? > $R/ctl/rc
echo "rxe-vm-init: done after $(cut -d' ' -f1 /proc/uptime) s"
sync
poweroff -f
