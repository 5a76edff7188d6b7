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
