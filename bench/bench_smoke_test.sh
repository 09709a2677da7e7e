#!/usr/bin/env bash
# The benchmarks run end to end, and what they count (not time) holds:
#   * engine_benchmark: the steady-state submit -> complete -> release path
#     makes no heap allocation per slice (BM_EngineSteadyState counts every
#     operator new in the process) over a null transport, and next to none
#     over TCP (a queue may grow once more while measuring);
#   * scale_benchmark: prints its three figures with their ratios and
#     checks the bytes it moved (it exits non-zero otherwise).
# No timing is asserted.
set -uo pipefail
dir="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench"
fail=0
json="${TEST_TMPDIR:-/tmp}/engine_benchmark.json"
out="$("$dir/engine_benchmark" --benchmark_filter='SteadyState|EngineTcpWrite/65536' \
  --benchmark_min_time=0.05 --benchmark_out="$json" --benchmark_out_format=json 2>&1)"
if python3 - "$json" <<'PY'; then
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
names = [r["name"] for r in runs]
assert sum(n.startswith("BM_EngineSteadyState/") for n in names) == 5, names
assert any(n.startswith("BM_EngineTcpWrite/65536") for n in names), names
for r in runs:
    assert "error_message" not in r, r
    # The null transport path is exact; over TCP a queue may still grow
    # once to a new high-water mark while measuring.
    limit = 0 if r["name"].startswith("BM_EngineSteadyState/") else 0.01
    assert r["allocs_per_slice"] <= limit, (r["name"], r["allocs_per_slice"])
    print("ok  ", r["name"], "allocs_per_slice", r["allocs_per_slice"])
PY
  echo "ok   no allocation per slice"
else
  echo "FAIL engine_benchmark: $out"; fail=1
fi
out="$("$dir/scale_benchmark" --mib_per_gpu=2 --peers=50 2>&1)"
for want in "^buffers on every GPU: .* ratio [0-9.]*;" "^buffer on GPU 0 alone: .* ratio [0-9.]*;" \
            "^50 open peers: heap +.*(ratio [0-9.]*)"; do
  if grep -q "$want" <<<"$out"; then echo "ok   $want"; else echo "FAIL $want: $out"; fail=1; fi
done
exit $fail
