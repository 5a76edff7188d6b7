#!/usr/bin/env bash
# rxe_vm.sh: runs one command inside a small qemu VM that has a real RDMA verbs device, rxe0
# (Soft-RoCE, the kernel's rdma_rxe), and exits with the command's exit status.
#
#   rxe_vm.sh [--share DIR]... [--share-rw DIR]... [--cwd DIR] [--env NAME=VALUE]...
#             [--timeout S] [--cache-dir DIR] [--mem MIB] [--smp N] [--check] -- COMMAND [ARG]...
#
# Why a VM: the build machines have no RDMA NIC and their kernels no RDMA subsystem, but Debian's
# stock kernel (linux-image-amd64) has rdma_rxe. qemu boots it under software emulation (TCG: the
# machine's /dev/kvm may not run a stock kernel) in a few seconds. The VM's root is a tmpfs built
# from the host's /usr and /etc (read-only 9p shares), so host-built binaries and their libraries
# (libibverbs, UCX, sanitizer runtimes) run unchanged; every --share DIR appears at the same
# absolute path, so paths compiled into test binaries stay valid.
#
# Options:
#   --share DIR       make host DIR visible read-only at the same path (repeatable)
#   --share-rw DIR    the same, writable from inside the VM
#   --cwd DIR         working directory of the command (default: the current directory when it is
#                     inside a share, else /tmp)
#   --env NAME=VALUE  set a variable for the command (repeatable). The command starts with a clean
#                     environment plus PATH, HOME, TMPDIR, RXE_IP (rxe0's IPv4 address),
#                     UCX_UD_VERBS_ETH_DGID_CHECK=n (without it UCX's ud_verbs, and so rc_verbs'
#                     wireup, loses every packet on rxe) and the host's ASAN_/UBSAN_/LSAN_/
#                     TSAN_OPTIONS, UCX_* and PDLIB_* variables.
#   --timeout S       hard limit in seconds for boot + command + power-off (default 120); the
#                     command itself is stopped (exit 124) 15 s before it so its output survives
#   --cache-dir DIR   where the initramfs is cached, keyed by kernel version and the contents of
#                     vm_init.sh (default /tmp/pdlib-rxe-vm-$UID); safe to share between
#                     concurrent runs
#   --mem MIB, --smp N  VM memory (default 2048) and vCPUs (default 2: busy-polling peers need one
#                     each)
#   --check           only check that the VM can be used here (exit 0 or the skip status)
# Environment: PDLIB_RXE_VM=off skips every run; PDLIB_RXE_VM_KERNEL=VERSION picks a kernel from
# /boot (default: the newest one whose modules include rdma_rxe); RXE_VM_VERBOSE=1 prints the VM
# console.
#
# Output: the command's output, then one line on stderr:
#   rxe-vm: ran on rxe0 (rdma_rxe, kernel 6.1.0-..., ...): exit 0 after 8.4 s (tcg)
# Exit status: the command's; 77 (printing "SKIP: <reason>") when this machine cannot run the VM
# (no qemu, no kernel image with rdma_rxe, unreadable kernel, ...); 124 at the timeout; 125 when
# the VM failed to set itself up (the reason and the console's tail are printed). A command that
# exits 77 itself is reported as skipped too.
set -euo pipefail

readonly SKIP=77
readonly VM_FAILED=125
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE

die() {
  echo "rxe-vm: $*" >&2
  exit 2
}
skip() {
  echo "SKIP: $*"
  exit $SKIP
}

shares=()      # "path mode"
cmd_env=()     # NAME=VALUE
cwd=""
timeout_s=120
cache_dir="/tmp/pdlib-rxe-vm-$(id -u)"
mem_mib=2048
smp=2
check_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --share | --share-rw)
      [ $# -ge 2 ] || die "$1 needs a directory"
      [ -d "$2" ] || die "$1 $2: no such directory"
      mode=ro
      [ "$1" = --share-rw ] && mode=rw
      [[ $2 != *[[:space:],]* ]] || die "$1 $2: paths with spaces or commas are not supported"
      shares+=("$(realpath -s "$2") $mode")
      shift 2
      ;;
    --cwd) [ $# -ge 2 ] || die "--cwd needs a directory"; cwd=$(realpath -s "$2"); shift 2 ;;
    --env)
      if [ $# -lt 2 ] || [[ $2 != [A-Za-z_]*=* ]]; then die "--env needs NAME=VALUE"; fi
      cmd_env+=("$2")
      shift 2
      ;;
    --timeout) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--timeout needs seconds"; timeout_s=$2; shift 2 ;;
    --cache-dir) [ $# -ge 2 ] || die "--cache-dir needs a directory"; cache_dir=$2; shift 2 ;;
    --mem) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--mem needs MiB"; mem_mib=$2; shift 2 ;;
    --smp) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--smp needs a count"; smp=$2; shift 2 ;;
    --check) check_only=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see the top of $0)" ;;
    *) break ;;
  esac
done
[ $check_only = 1 ] || [ $# -gt 0 ] || die "no command given (usage at the top of $0)"
[ "$timeout_s" -ge 30 ] || die "--timeout must be at least 30 s (boot alone takes ~5 s, more under load)"

# --- Can this machine run the VM at all? Every "no" is a skip with its reason. -------------------
case "${PDLIB_RXE_VM:-}" in
  off | OFF | 0 | no) skip "PDLIB_RXE_VM=${PDLIB_RXE_VM} turns the Soft-RoCE VM tests off" ;;
esac
[ "$(uname -m)" = x86_64 ] || skip "the Soft-RoCE VM needs an x86_64 host (this is $(uname -m))"
QEMU=$(command -v qemu-system-x86_64 || true)
[ -n "$QEMU" ] || skip "qemu-system-x86_64 not found (Debian: apt-get install qemu-system-x86; scripts/install-deps.sh installs it)"
BUSYBOX=""
for b in /usr/bin/busybox /bin/busybox; do
  [ -x $b ] || continue
  # ldd exits 1 for a static binary; only its message tells "static" from "not ELF".
  if [[ $(LC_ALL=C ldd $b 2>&1 || true) == *"not a dynamic executable"* ]]; then BUSYBOX=$b; break; fi
done
[ -n "$BUSYBOX" ] || skip "no statically linked busybox (Debian: apt-get install busybox-static)"
for tool in cpio gzip flock; do
  command -v $tool > /dev/null || skip "$tool not found"
done
RDMA_TOOL=$(PATH=/usr/bin:/usr/sbin:/bin:/sbin command -v rdma || true)
[ -n "$RDMA_TOOL" ] || skip "the rdma tool (iproute2) is not installed"
[ -x /usr/bin/ibv_devinfo ] || skip "ibv_devinfo not found (Debian: apt-get install ibverbs-utils)"

# The kernel: one from /boot whose modules include rdma_rxe.
find_module() {  # find_module KV NAME -> path of NAME.ko[.xz|.zst] under /lib/modules/KV, or ""
  local p
  p=$(grep -E "(^|/)$2\.ko(\.xz|\.zst|\.gz)?:" "/lib/modules/$1/modules.dep" 2>/dev/null | head -1 | cut -d: -f1)
  [ -n "$p" ] && echo "/lib/modules/$1/$p"
  return 0
}
KV=""
if [ -n "${PDLIB_RXE_VM_KERNEL:-}" ]; then
  KV=$PDLIB_RXE_VM_KERNEL
else
  for img in $(ls /boot/vmlinuz-* 2>/dev/null | sort -V -r); do
    v=${img#/boot/vmlinuz-}
    if [ -n "$(find_module "$v" rdma_rxe)" ]; then KV=$v; break; fi
  done
fi
[ -n "$KV" ] || skip "no kernel image in /boot with the rdma_rxe module (Debian: apt-get install linux-image-amd64)"
KERNEL=/boot/vmlinuz-$KV
[ -f "$KERNEL" ] || skip "$KERNEL does not exist"
[ -r "$KERNEL" ] || skip "$KERNEL is not readable by uid $(id -u) (Debian installs it mode 0600; run as root or chmod a+r it)"
[ -n "$(find_module "$KV" rdma_rxe)" ] || skip "kernel $KV has no rdma_rxe module in /lib/modules/$KV"
if [ $check_only = 1 ]; then
  echo "rxe-vm: usable: kernel $KV, $QEMU, $BUSYBOX"
  exit 0
fi

# --- The initramfs: busybox, vm_init.sh and the modules, cached per kernel and init script. ------
# Modules, each after the ones it needs (modules.dep); crc32_generic is not listed as rdma_rxe's
# dependency but rdma_rxe cannot start without a crc32 implementation. veth and sch_tbf: rails
# whose rate is capped (test/rxe/rails.sh).
WANTED="virtio_pci 9pnet_virtio 9p dummy veth sch_tbf crc32_generic rdma_rxe ib_uverbs rdma_ucm"
key=$(cat "$HERE/vm_init.sh" <(echo "$WANTED") | sha256sum | cut -c1-12)
INITRAMFS=$cache_dir/initramfs-$KV-$key.cpio.gz

build_initramfs() {
  local tmp order=() seen=" " m
  tmp=$(mktemp -d "$cache_dir/build.XXXXXX")
  mkdir -p "$tmp/root/bin" "$tmp/root/modules" "$tmp/root/proc" "$tmp/root/sys" "$tmp/root/dev"
  cp "$BUSYBOX" "$tmp/root/bin/busybox"
  for applet in $("$BUSYBOX" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$tmp/root/bin/$applet"
  done
  cp "$HERE/vm_init.sh" "$tmp/root/init"
  chmod 755 "$tmp/root/init"
  add() {  # add RELATIVE_PATH: its dependencies first, then itself
    local rel=$1 d
    case "$seen" in *" $rel "*) return ;; esac
    seen="$seen$rel "
    for d in $(grep -E "^$rel:" "/lib/modules/$KV/modules.dep" | cut -d: -f2); do add "$d"; done
    order+=("$rel")
  }
  for m in $WANTED; do
    local path
    path=$(find_module "$KV" "$m")
    if [ -z "$path" ]; then
      if grep -qE "/$m\.ko$" "/lib/modules/$KV/modules.builtin" 2>/dev/null; then continue; fi
      rm -rf "$tmp"
      skip "kernel $KV has no module $m (needed by the Soft-RoCE VM)"
    fi
    add "${path#/lib/modules/"$KV"/}"
  done
  : > "$tmp/root/modules/order"
  for m in "${order[@]}"; do
    local src=/lib/modules/$KV/$m name
    name=$(basename "$m")
    case "$name" in
      *.ko) cp "$src" "$tmp/root/modules/$name" ;;
      *.ko.xz) name=${name%.xz}; xz -dc "$src" > "$tmp/root/modules/$name" || skip "cannot decompress $src (xz)" ;;
      *.ko.zst) name=${name%.zst}; zstd -qdc "$src" > "$tmp/root/modules/$name" || skip "cannot decompress $src (zstd)" ;;
      *.ko.gz) name=${name%.gz}; gzip -dc "$src" > "$tmp/root/modules/$name" ;;
    esac
    echo "$name" >> "$tmp/root/modules/order"
  done
  (cd "$tmp/root" && find . | cpio -o -H newc --quiet | gzip -1) > "$tmp/initramfs.cpio.gz"
  # Older images of this kernel (built from an earlier vm_init.sh) are not used any more; a VM
  # that booted from one has already read it.
  find "$cache_dir" -maxdepth 1 -name "initramfs-$KV-*.cpio.gz" ! -name "${INITRAMFS##*/}" -delete
  mv -f "$tmp/initramfs.cpio.gz" "$INITRAMFS"  # atomic: a concurrent run sees all or nothing
  rm -rf "$tmp"
}

mkdir -p "$cache_dir"
if [ ! -s "$INITRAMFS" ]; then
  # One builder at a time; a run that waited finds the file built.
  exec 9> "$cache_dir/.lock"
  flock 9
  [ -s "$INITRAMFS" ] || build_initramfs
  flock -u 9
  exec 9>&-
fi

# --- This run's control folder: the command, the shares, and what the VM writes back. -----------
ctl=$(mktemp -d "$cache_dir/run.XXXXXX")
qemu_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  if [ -n "$qemu_pid" ]; then
    # TERM reaches qemu through timeout(1); KILL only if it lingers.
    kill -TERM "$qemu_pid" 2> /dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$qemu_pid" 2> /dev/null && sleep 0.2; done
    kill -KILL "$qemu_pid" 2> /dev/null
  fi
  rm -rf "$ctl"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Shares: each at its path; one inside another share is already visible.
fsdev_args=()
: > "$ctl/shares"
n=0
for s in "${shares[@]}"; do
  path=${s% *}
  mode=${s##* }
  covered=0
  for t in "${shares[@]}"; do
    other=${t% *}
    if [ "$other" != "$path" ] && [[ $path == "$other"/* ]] && { [ "${t##* }" = rw ] || [ "$mode" = ro ]; }; then covered=1; fi
  done
  [ $covered = 1 ] && continue
  grep -q " $path " "$ctl/shares" && continue
  ro=""
  [ "$mode" = ro ] && ro=",readonly=on"
  fsdev_args+=(-fsdev "local,id=s$n,path=$(realpath "$path"),security_model=none$ro"
    -device "virtio-9p-pci,fsdev=s$n,mount_tag=s$n")
  echo "s$n $path $mode" >> "$ctl/shares"
  n=$((n + 1))
done
sort -k2 -o "$ctl/shares" "$ctl/shares"  # a folder is mounted before the shares inside it

if [ -z "$cwd" ]; then
  cwd=/tmp
  here=$(realpath -s "$PWD")
  while read -r _ path _; do
    if [ "$here" = "$path" ] || [[ $here == "$path"/* ]]; then cwd=$here; fi
  done < "$ctl/shares"
fi

# The command's environment: what the caller asked for, plus sanitizer, UCX and pdlib settings.
inner_timeout=$((timeout_s - 15))
{
  echo "#!/bin/bash"
  # UCX's UD transport (rc's wireup transport too) drops every packet rdma_rxe delivers unless its
  # destination-GID check is off: UCX 1.13 expects another layout of the RoCE v2 IPv4 header.
  echo "export UCX_UD_VERBS_ETH_DGID_CHECK=n"
  while IFS= read -r -d '' var; do
    case "$var" in
      ASAN_OPTIONS=* | UBSAN_OPTIONS=* | LSAN_OPTIONS=* | TSAN_OPTIONS=* | UCX_* | PDLIB_*)
        printf 'export %q\n' "$var" ;;
    esac
  done < /proc/self/environ
  for var in "${cmd_env[@]}"; do printf 'export %q\n' "$var"; done
  printf 'cd %q || exit 125\n' "$cwd"
  printf 'exec /usr/bin/timeout -k 5 %d' "$inner_timeout"
  printf ' %q' "$@"
  echo
} > "$ctl/cmd.sh"

# --- Boot. ---------------------------------------------------------------------------------------
# no_timer_check: on a starved host, TCG's timer can miss the kernel's IO-APIC timer check, which
# then panics ("IO-APIC + timer doesn't work!") before anything runs.
boot() {  # boot SECONDS: one VM run; qemu's exit status in $qemu_rc
  timeout -k 5 "$1" "$QEMU" -accel tcg,thread=multi -cpu max -m "$mem_mib" -smp "$smp" \
    -nodefaults -no-user-config -display none -no-reboot -serial "file:$ctl/console.log" \
    -kernel "$KERNEL" -initrd "$INITRAMFS" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off no_timer_check" \
    -fsdev "local,id=usr,path=/usr,security_model=none,readonly=on" \
    -device "virtio-9p-pci,fsdev=usr,mount_tag=usr" \
    -fsdev "local,id=etc,path=/etc,security_model=none,readonly=on" \
    -device "virtio-9p-pci,fsdev=etc,mount_tag=etc" \
    -fsdev "local,id=ctl,path=$ctl,security_model=none" \
    -device "virtio-9p-pci,fsdev=ctl,mount_tag=ctl" \
    "${fsdev_args[@]}" < /dev/null > "$ctl/qemu.log" 2>&1 &
  qemu_pid=$!
  wait $qemu_pid
  qemu_rc=$?
  qemu_pid=""
}
start=$(date +%s%N)
set +e
boot "$timeout_s"
# A VM that died before it started the command (a kernel panic at boot on a starved host) gets
# one more try within the same deadline; one that ran the command is never run twice.
left=$((timeout_s - ($(date +%s%N) - start) / 1000000000))
if [ ! -f "$ctl/rc" ] && [ ! -f "$ctl/device" ] && [ "$qemu_rc" != 124 ] && [ "$left" -ge 20 ]; then
  echo "rxe-vm: the VM stopped before the command started (qemu exit $qemu_rc); console tail:" >&2
  tr -d '\r' < "$ctl/console.log" | tail -5 >&2
  echo "rxe-vm: booting once more" >&2
  boot "$left"
fi
set -e
seconds=$(( ($(date +%s%N) - start) / 1000000 ))
seconds=$((seconds / 1000)).$(( (seconds % 1000) / 100 ))

[ -n "${RXE_VM_VERBOSE:-}" ] && tr -d '\r' < "$ctl/console.log" >&2
[ -f "$ctl/out" ] && cat "$ctl/out"
device=$(cat "$ctl/device" 2> /dev/null || echo "no RDMA device")
if [ -f "$ctl/rc" ]; then
  rc=$(cat "$ctl/rc")
  if [ -f "$ctl/error" ]; then
    echo "rxe-vm: the VM could not set itself up: $(cat "$ctl/error")" >&2
    tr -d '\r' < "$ctl/console.log" | tail -20 >&2
  fi
elif [ $qemu_rc = 124 ] || [ $qemu_rc = 137 ]; then
  echo "rxe-vm: TIMEOUT: no result within --timeout $timeout_s s; console tail:" >&2
  tr -d '\r' < "$ctl/console.log" | tail -20 >&2
  rc=124
else
  echo "rxe-vm: the VM ended without a result (qemu exit $qemu_rc); qemu and console tail:" >&2
  tail -5 "$ctl/qemu.log" >&2
  tr -d '\r' < "$ctl/console.log" | tail -20 >&2
  rc=$VM_FAILED
fi
echo "rxe-vm: ran on $device: exit $rc after $seconds s (tcg, $smp vCPUs, $mem_mib MiB)" >&2
exit "$rc"
