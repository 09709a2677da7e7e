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
echo "devices_test: ok"
