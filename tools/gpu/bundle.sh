#!/usr/bin/env bash
# Builds the GPU check (-c opt) and gathers it, with every shared library it
# needs except libcuda and glibc's own, into one folder (default
# gpu-check/) that runs on a machine without Bazel or Debian's packages
# (glibc >= 2.36): copy the folder there and run ./check.sh in it.
#
#   tools/gpu/bundle.sh [OUT_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/gpu-check}"
cd "$root"
./bazelw build -c opt //tools/gpu:gpu_check >&2
bin="$(readlink -f bazel-bin/tools/gpu/gpu_check)"
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "$bin" "$out/bin/gpu_check"
cp tools/gpu/check.sh "$out/check.sh"
# Every library the loader resolves, except the C library's (the target's
# glibc serves those) and the CUDA driver (the target's own).
ldd "$bin" | awk '/=> \//{print $1, $3}' | while read -r name path; do
  case "$name" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libcuda.so*) ;;
    *) cp -L "$path" "$out/lib/$name" ;;
  esac
done
chmod -R u+w "$out"
strip --strip-unneeded "$out/bin/gpu_check" "$out"/lib/*.so* 2>/dev/null || true
size_kib="$(du -sk "$out" | cut -f1)"
if (( size_kib > 64 * 1024 )); then
  echo "bundle.sh: $out is ${size_kib} KiB, over the 64 MiB limit" >&2
  exit 1
fi
echo "bundle.sh: $out ($(( size_kib / 1024 )) MiB): copy it to the GPU machine and run ./check.sh there" >&2
