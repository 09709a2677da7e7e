#!/usr/bin/env bash
# Runs the GPU check from the folder tools/gpu/bundle.sh made (it sits next
# to this script there): device memory between two processes over TCP
# staging, CUDA IPC and VMM memory through fds (and over RDMA where the
# host has a device), each verified in the receiving process after Wait; on
# each path a stream-ordered WRITE and a checksummed KV request over device
# pools; throughput against a device-to-device cuMemcpy and a host-to-host
# TCP stream of the same run.
# Needs the machine's CUDA driver (libcuda.so.1) and glibc >= 2.36; nothing
# else (no Bazel, no Debian packages). Ends with "N passed, N failed".
#
#   ./check.sh [--mib=256] [--rounds=3] [--src_device=0] [--dst_device=N]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/gpu_check"
[[ -x "$bin" ]] || bin="$here/bin/gpu_check"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec timeout 290 "$bin" "$@"
