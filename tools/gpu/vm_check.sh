#!/bin/sh
# gpu_check inside the Soft-RoCE VM (CI's softroce stage ships gpu_check
# and the fake driver to /t/): every path of the real-GPU check, the verbs
# one included, against the fake driver in its peermem mode (device memory
# rxe can register). Each PASS/FAIL line is reported as a test case for
# tools/test_summary.py; the verbs path must have run.
export KVFERRY_CUDA_LIBRARY=/t/libfakecuda.so KVFERRY_FAKE_CUDA_PEERMEM=1
out=/tmp/gpu_check.out
/t/gpu_check --mib=8 --rounds=1 >"$out" 2>&1
rc=$?
cat "$out"
n=0
while IFS= read -r line; do
  case "$line" in
    "PASS "*) n=$((n + 1)); echo "[       OK ] gpu_check_vm.check$n (0 ms) ${line#PASS }" ;;
    "FAIL "*) n=$((n + 1)); echo "[  FAILED  ] gpu_check_vm.check$n (0 ms) ${line#FAIL }" ;;
  esac
done <"$out"
if ! grep -q "^PASS device memory between two processes over RDMA, verified" "$out"; then
  echo "[  FAILED  ] gpu_check_vm.rdma_path_ran (0 ms)"
  exit 1
fi
exit "$rc"
