#!/usr/bin/env bash
# tools/gpu/check.sh and gpu_check against the fake CUDA driver: every
# path passes and the summary line is there; without a driver it fails
# clearly.
set -euo pipefail
runfiles="$TEST_SRCDIR/$TEST_WORKSPACE"
dir="$TEST_TMPDIR/bundle"
mkdir -p "$dir/lib"
cp "$runfiles/tools/gpu/check.sh" "$runfiles/tools/gpu/gpu_check" "$dir/"
export KVFERRY_CUDA_LIBRARY="$runfiles/cuda/testing/libfakecuda.so"
out="$("$dir/check.sh" --mib=8 --rounds=2 2>/dev/null)"
echo "$out"
grep -q "PASS device memory between two processes over TCP staging, verified" <<<"$out"
grep -q "PASS device memory between two processes over CUDA IPC, verified" <<<"$out"
grep -q "PASS VMM device memory (20 MiB chunks) between two processes through POSIX fds, verified" <<<"$out"
grep -q "TCP staging / host TCP stream: " <<<"$out"
grep -q "VMM fds / device-to-device cuMemcpy: " <<<"$out"
grep -q "PASS device memory between two processes over CUDA IPC: a stream-ordered WRITE behind an asynchronous copy, verified" <<<"$out"
grep -q "PASS VMM device memory (20 MiB chunks) between two processes through POSIX fds: a KV request over device pools with checksums, verified" <<<"$out"
grep -q "^SKIP device memory over RDMA: no RDMA engine on this host" <<<"$out"
grep -qx "10 passed, 0 failed" <<<"$out"
if KVFERRY_CUDA_LIBRARY=/nonexistent/libcuda.so.1 "$dir/check.sh" --mib=1 >"$TEST_TMPDIR/none.txt" 2>&1; then
  echo "passed without a driver"; exit 1
fi
grep -q "no CUDA driver" "$TEST_TMPDIR/none.txt"
grep -qx "0 passed, 1 failed" "$TEST_TMPDIR/none.txt"
echo "gpu_check_test: ok"
