#!/usr/bin/env bash
# //tools:devices against a fixture tree, as JSON and text, and on a host
# without RDMA.
set -euo pipefail
devices="$TEST_SRCDIR/$TEST_WORKSPACE/tools/devices"
manifest="$TEST_SRCDIR/$TEST_WORKSPACE/tests/fixtures/sysfs/mixed_gids.tree"

# Materialize the manifest (dir / file / link lines) with real symlinks.
root="$TEST_TMPDIR/tree"
while read -r kind path rest; do
  case "$kind" in
    dir) mkdir -p "$root/$path" ;;
    file) mkdir -p "$(dirname "$root/$path")"; printf '%s\n' "$rest" >"$root/$path" ;;
    link) mkdir -p "$(dirname "$root/$path")"; ln -s "$rest" "$root/$path" ;;
  esac
done < <(grep -v '^#' "$manifest")

out="$("$devices" --sysfs_root="$root/sys" --dev_root="$root/dev")"
echo "$out"
grep -q "mlx5_0:1 selected: Ethernet, GID 3: RoCE v2, routable IPv4 10.1.2.3" <<<"$out"
grep -q "rxe0:1 selected: Ethernet, GID 1: RoCE v2, loopback address" <<<"$out"

json="$("$devices" --sysfs_root="$root/sys" --dev_root="$root/dev" --json)"
python3 - "$json" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
assert [s["device"] for s in d["selected"]] == ["mlx5_0", "rxe0"], d["selected"]
assert d["selected"][0]["gid_index"] == 3
PY

empty="$("$devices" --sysfs_root="$TEST_TMPDIR/nothing")"
grep -q "No RDMA devices" <<<"$empty"

if "$devices" --sysfs_root="$root/sys" --dev_root="$root/dev" --devices=mlx5_9 2>err.txt; then
  echo "a missing device was accepted"; exit 1
fi
grep -q "mlx5_9' does not exist; available: mlx5_0" err.txt
# Without a CUDA driver: said so. With the fake one: the GPUs by CUDA
# ordinal and PCI address, and how RDMA would register their memory.
grep -q "CUDA: none" <<<"$(KVFERRY_CUDA_LIBRARY=/nonexistent/libcuda.so.1 "$devices" --sysfs_root="$TEST_TMPDIR/nothing")"
fake="$TEST_SRCDIR/$TEST_WORKSPACE/cuda/testing/libfakecuda.so"
gpus="$(KVFERRY_CUDA_LIBRARY="$fake" KVFERRY_FAKE_CUDA_PCI=0000:65:00.0,0000:1B:00.0 \
        "$devices" --sysfs_root="$root/sys" --dev_root="$root/dev")"
echo "$gpus"
grep -q "cuda:0  PCI 0000:65:00.0  dma-buf no" <<<"$gpus"
grep -q "cuda:1  PCI 0000:1b:00.0" <<<"$gpus"
grep -q "RDMA cannot register its memory (no dma-buf, no nvidia-peermem)" <<<"$gpus"
grep -q "VMM memory (expandable segments) through POSIX fds" <<<"$gpus"
cuda_json="$(KVFERRY_CUDA_LIBRARY="$fake" "$devices" --sysfs_root="$root/sys" --dev_root="$root/dev" --json)"
python3 - "$cuda_json" <<'PY'
import json, sys
c = json.loads(sys.argv[1])["cuda"]
assert [g["ordinal"] for g in c["gpus"]] == [0, 1], c
assert c["gpus"][0]["pci"] == "0000:1b:00.0" and c["gpus"][0]["dma_buf"] is False, c
assert c["gpus"][0]["vmm_fds"] is True, c
assert c["error"] == "" and c["peermem"] is False, c
PY
echo "devices_test: ok"
