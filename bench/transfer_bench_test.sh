#!/usr/bin/env bash
# transfer_bench works end to end (over TCP on this host): each mode prints
# its RESULT line with a positive figure, and bad flags fail with a message.
# No timing is asserted.
set -uo pipefail
bench="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/transfer_bench"
fail=0
check() {  # check NAME EXPECTED_MODE ARGS...
  local name="$1" want="$2"; shift 2
  local out; out="$("$bench" --transport=tcp "$@" 2>&1)"
  local line; line="$(grep '^RESULT ' <<<"$out")"
  if [[ "$line" != "RESULT mode=$want "* ]] ||
     ! awk '{for (i = 1; i <= NF; i++) if ($i ~ /^value=/) {split($i, v, "="); exit !(v[2] > 0)}}' <<<"$line"; then
    echo "FAIL $name: $out"; fail=1
  else
    echo "ok   $name: $line"
  fi
}
check write_bw bw --mode=bw --block=65536 --depth=16 --iters=256 --warmup=16
check read_bw bw --mode=bw --op=read --block=4096 --depth=8 --iters=64 --warmup=8
check latency lat --mode=lat --block=8 --iters=50 --warmup=5
# --json: one parseable object with the figures.
for mode in bw lat; do
  out="$("$bench" --transport=tcp --mode=$mode --block=4096 --depth=8 --iters=64 --warmup=8 --json 2>&1)"
  if python3 -c 'import json, sys; d = json.loads(sys.argv[1]); assert d["mode"] == sys.argv[2]
assert (d["mib_per_s"] > 0 and d["batch_us_p99"] >= d["batch_us_p50"] > 0) if d["mode"] == "bw" else (d["one_way_us_p999"] >= d["one_way_us_p50"] > 0)' "$out" "$mode"; then
    echo "ok   json $mode: $out"
  else
    echo "FAIL json $mode: $out"; fail=1
  fi
done
for bad in "--mode=fast" "--op=copy"; do
  if out="$("$bench" --transport=tcp $bad 2>&1)"; then
    echo "FAIL $bad was accepted: $out"; fail=1
  elif ! grep -q "must be" <<<"$out"; then
    echo "FAIL $bad: no clear message: $out"; fail=1
  else
    echo "ok   $bad rejected: $out"
  fi
done
exit $fail
