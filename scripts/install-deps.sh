#!/usr/bin/env bash
# Installs everything pdlib's build, tests and benchmarks need, from Debian 12's archive.
# Idempotent: does nothing (and needs no network) when every package is already present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  clang clang-format libclang-rt-14-dev
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc
  libucx-dev ucx-utils
  libibverbs-dev rdma-core ibverbs-utils
  catch2 libbenchmark-dev
  # JSON (router API, safetensors headers, bench/chaos output) and the router's HTTP/1.1 server
  # (issue #15: well-kept libraries instead of hand-written parsers). Debian's cpp-httplib is a
  # compiled library (libcpp-httplib.so, found through pkg-config), not header-only.
  nlohmann-json3-dev libcpp-httplib-dev
  # The Soft-RoCE VM tests (test/rxe/): qemu boots Debian's stock kernel, whose rdma_rxe module
  # gives a real verbs device; busybox-static and cpio make its initramfs, kmod and iproute2
  # (the rdma tool) set the device up, perftest and ibverbs-providers run on it.
  qemu-system-x86 linux-image-amd64 busybox-static cpio kmod iproute2
  ibverbs-providers perftest
  # valgrind_* tests (memcheck over two processes); openssl makes the TLS test's certificates.
  valgrind openssl
  # NetnsCluster (tools/netns, issue #18): nft puts packet loss and partitions on a host's link
  # (this kernel has no sch_netem); iperf3 measures a link's baseline throughput.
  nftables iperf3
  # The Python package (python/): pybind11 for the module; numpy, torch and pytest for its tests,
  # the example engine pair and the benchmark.
  python3-dev pybind11-dev python3-pybind11 python3-numpy python3-pytest python3-torch
  # mypy type-checks the package and its stubs (ctest "python: mypy --strict").
  mypy
  # pip install ./python into a virtualenv (ctest "python: pip install"; python3 -m build for a
  # wheel), offline with the interpreter's own build tools.
  python3-venv python3-pip python3-setuptools python3-wheel python3-build
  # The C API's Rust example (examples/rust, ctest "examples: rust"): Debian's rustc, std only.
  rustc
  # The etcd client's tests (ctest -R etcd, issue #18) start a real etcd (3.4) on free local
  # ports; etcdctl enables auth on it for the authentication test.
  etcd-server etcd-client
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
