#!/usr/bin/env bash
# No binary or library of the project links the CUDA driver: it is opened
# at run time (cuda/driver.h). Checks the ELF NEEDED entries and what the
# loader resolves.
set -euo pipefail
runfiles="$TEST_SRCDIR/$TEST_WORKSPACE"
checked=0
for f in python/kvferry.so tools/devices tools/gpu/gpu_check tools/demo; do
  path="$runfiles/$f"
  [[ -e "$path" ]] || { echo "missing $f"; exit 1; }
  if readelf -d "$path" | grep -i "NEEDED.*cuda"; then
    echo "$f lists a CUDA library as NEEDED"; exit 1
  fi
  if ldd "$path" 2>/dev/null | grep -i "libcuda"; then
    echo "$f resolves a CUDA library at load time"; exit 1
  fi
  checked=$((checked + 1))
done
echo "no libcuda in $checked binaries"
