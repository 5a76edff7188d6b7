#!/usr/bin/env bash
# scripts/gpu-bundle.sh: carries the GPU checks (scripts/gpu-check.sh) to a lent GPU machine whose
# image has CUDA but none of pdlib's build dependencies (gRPC, Abseil, UCX, Catch2, ...), so that
# they run there without a build (docs/DEVELOPERS.md, "Running the GPU checks").
#
#   scripts/gpu-bundle.sh pack            # here: build what gpu-check runs, then
#                                         # .gpu-bundle/pdlib-gpu.tar.xz (under 64 MiB)
#   scripts/gpu-bundle.sh run [ARGS...]   # there, from the repository root, with .gpu-bundle
#                                         # carried: unpack, then gpu-check.sh --no-build ARGS
#
# The bundle holds the executables gpu-check.sh runs (stripped), ctest's test lists, and every
# shared library they load, the C library and its loader included (not libcuda: the machine's
# driver provides it, linked in at run time). The executables' interpreter and RPATH point at
# <root>/build/release/.gpu-lib, and tests find their helpers by absolute paths, so the bundle
# runs where it was packed (<root>, this checkout's path): `run` makes <root> a link to the
# repository root there when they differ, and says so when it cannot.
set -u -o pipefail

build_dir=build/release
bundle_dir=.gpu-bundle
bundle="$bundle_dir/pdlib-gpu.tar.xz"
lib_rel=".gpu-lib"  # under build_dir

if [ ! -f CMakePresets.json ] || [ ! -d scripts ]; then
  echo "gpu-bundle: run from the repository root" >&2
  exit 2
fi

# What gpu-check.sh runs, by file name under build_dir (test helpers included).
executables=(
  pd-demo pd-prefill pd-decode pd-router pdlib-bootstrap pdlib-transfer-bench
  pdlib_kernel_bench pdlib_cuda_info pdlib_relayout_bench pdlib_digest_bench
  backend_conformance_test hosts_engine_test planner_e2e_test pdlib_planner_peer pdlib_test_peer
  kernel_cuda_test cuda_ipc_transport_test cuda_ipc_multiprocess_test copy_plan_test
  gather_copy_test digest_math_test digest_kernel_test
)

pack() {
  local root
  root="$(pwd)"
  command -v patchelf > /dev/null || {
    echo "gpu-bundle: installing patchelf (apt)"
    apt-get install -y -q patchelf > /dev/null || {
      echo "gpu-bundle: patchelf is missing and could not be installed" >&2
      exit 1
    }
  }
  scripts/gpu-check.sh --build-only --out "$bundle_dir/build-log" || exit 1

  stage=""  # global: the EXIT trap removes it
  stage="$(mktemp -d)"
  trap 'rm -rf "$stage"' EXIT
  local lib="$stage/$build_dir/$lib_rel"
  mkdir -p "$lib"
  local found=() missing=()
  for name in "${executables[@]}"; do
    local path
    path="$(find "$build_dir" -name "$name" -type f -perm -u+x -not -path '*/CMakeFiles/*' | head -1)"
    if [ -z "$path" ]; then
      missing+=("$name")
      continue
    fi
    found+=("$path")
    mkdir -p "$stage/$(dirname "$path")"
    strip --strip-unneeded -o "$stage/$path" "$path"
  done
  [ ${#missing[@]} -eq 0 ] || echo "gpu-bundle: not in this build (left out): ${missing[*]}"
  if [[ " ${missing[*]} " == *" cuda_ipc_transport_test "* ]]; then
    echo "gpu-bundle: $build_dir has no cuda_ipc tests: configured without CUDA?" \
         "(rm -rf $build_dir; scripts/gpu-check.sh --build-only configures with CUDA)" >&2
    exit 1
  fi
  # ctest's test lists (and Catch's generated ones), which name the executables by absolute path.
  find "$build_dir" -not -path '*/CMakeFiles/*' \
    \( -name CTestTestfile.cmake -o -name '*_include-*.cmake' -o -name '*_tests-*.cmake' \) |
    while read -r f; do
      mkdir -p "$stage/$(dirname "$f")"
      cp "$f" "$stage/$f"
    done

  # Every shared library they load, by soname, from ldd; the loader under its own name.
  local interp=""
  for path in "${found[@]}"; do
    ldd "$path" | awk '
      $2 == "=>" && $3 ~ /^\// { print $1, $3; next }
      $1 ~ /^\// { n = split($1, p, "/"); print p[n], $1 }'
  done | sort -u | while read -r soname file; do
    case "$soname" in libcuda.so*) continue ;; esac
    cp -L "$file" "$lib/$soname"
  done
  interp="$(patchelf --print-interpreter "${found[0]}")"
  [ -f "$lib/$(basename "$interp")" ] || cp -L "$interp" "$lib/$(basename "$interp")"
  local new_interp
  new_interp="$root/$build_dir/$lib_rel/$(basename "$interp")"
  for path in "${found[@]}"; do
    patchelf --set-interpreter "$new_interp" --force-rpath --set-rpath "$root/$build_dir/$lib_rel" \
      "$stage/$path"
  done
  printf '%s\n' "$root" > "$stage/$build_dir/$lib_rel/ROOT"
  git rev-parse HEAD > "$stage/$build_dir/$lib_rel/COMMIT" 2>/dev/null || true

  mkdir -p "$bundle_dir"
  tar -C "$stage" -cf - "$build_dir" | xz -T0 -6 > "$bundle.tmp" && mv "$bundle.tmp" "$bundle"
  local bytes
  bytes=$(stat -c %s "$bundle")
  echo "gpu-bundle: $bundle: $((bytes / 1048576)) MiB, ${#found[@]} executables, $(find "$lib" -type f | wc -l) libraries, for $root"
  if [ "$bytes" -gt $((60 * 1048576)) ]; then
    echo "gpu-bundle: over 60 MiB: too big to carry with the working tree (64 MiB in all)" >&2
    exit 1
  fi
}

run() {
  [ -f "$bundle" ] || {
    echo "gpu-bundle: $bundle is missing: pack it here first and carry $bundle_dir" >&2
    exit 1
  }
  xz -dc "$bundle" | tar -xf - || exit 1
  local root here
  root="$(cat "$build_dir/$lib_rel/ROOT")"
  here="$(pwd -P)"
  if [ "$(cd "$root" 2> /dev/null && pwd -P)" != "$here" ]; then
    if [ -e "$root" ] || [ -L "$root" ]; then
      echo "gpu-bundle: the bundle runs at $root, which exists here and is not this checkout" >&2
      exit 1
    fi
    if ! { mkdir -p "$(dirname "$root")" && ln -s "$here" "$root"; }; then
      echo "gpu-bundle: cannot link $root to $here (the bundle's paths are absolute)" >&2
      exit 1
    fi
    echo "gpu-bundle: linked $root -> $here"
  fi
  # The driver's libcuda, where the bundled loader looks first.
  local libcuda=""
  for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/compat \
           /usr/lib/wsl/lib; do
    [ -e "$d/libcuda.so.1" ] && { libcuda="$d/libcuda.so.1"; break; }
  done
  [ -n "$libcuda" ] || libcuda="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / { print $NF; exit }')"
  if [ -n "$libcuda" ]; then
    ln -sf "$libcuda" "$build_dir/$lib_rel/libcuda.so.1"
    echo "gpu-bundle: libcuda: $libcuda"
  else
    echo "gpu-bundle: no libcuda.so.1 found (no NVIDIA driver?); the checks will say so"
  fi
  echo "gpu-bundle: packed at commit $(cat "$build_dir/$lib_rel/COMMIT" 2>/dev/null || echo '?')," \
       "checkout at $(git rev-parse HEAD 2>/dev/null || echo '?')"
  exec scripts/gpu-check.sh --no-build "$@"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
    ;;
esac
