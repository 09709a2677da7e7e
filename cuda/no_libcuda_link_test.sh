#!/usr/bin/env bash
# No binary or library of the project links the CUDA driver, libibverbs or
# librdmacm: each is opened at run time (cuda/driver.h,
# transport/verbs/ibv.h), so a host without them still runs over TCP.
# Checks the ELF NEEDED entries and what the loader resolves.
set -euo pipefail
runfiles="$TEST_SRCDIR/$TEST_WORKSPACE"
checked=0
for f in c/libkvferry.so tools/devices tools/gpu/gpu_check tools/demo; do
  path="$runfiles/$f"
  [[ -e "$path" ]] || { echo "missing $f"; exit 1; }
  if readelf -d "$path" | grep -iE "NEEDED.*(cuda|ibverbs|rdmacm)"; then
    echo "$f lists a CUDA or RDMA library as NEEDED"; exit 1
  fi
  if ldd "$path" 2>/dev/null | grep -iE "libcuda|libibverbs|librdmacm"; then
    echo "$f resolves a CUDA or RDMA library at load time"; exit 1
  fi
  checked=$((checked + 1))
done
echo "no libcuda, libibverbs or librdmacm in $checked binaries"
