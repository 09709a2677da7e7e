#!/usr/bin/env bash
# transfer_bench works end to end over TCP on this host: loopback and two
# processes (target + initiator), each mode prints its RESULT line with a
# positive figure and a reference ratio, --json parses, the sweep writes a
# CSV with a row per block and a PNG, bad flags fail with a message.
# No timing is asserted.
set -uo pipefail
bench="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/transfer_bench"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail=0
# check NAME EXPECTED_MODE EXPECTED_REFERENCE ARGS...
check() {
  local name="$1" want="$2" ref="$3"; shift 3
  local out; out="$("$bench" --transport=tcp "$@" 2>&1)"
  local line; line="$(grep '^RESULT ' <<<"$out")"
  if [[ "$line" != "RESULT mode=$want "* ]] ||
     ! awk '{for (i = 1; i <= NF; i++) if ($i ~ /^(value|ratio)=/) {split($i, v, "="); if (!(v[2] > 0)) exit 1}}' <<<"$line" ||
     { [[ "$ref" != none ]] && [[ "$line" != *" reference=$ref ratio="* ]]; }; then
    echo "FAIL $name: $out"; fail=1
  else
    echo "ok   $name: $line"
  fi
}
check write_bw bw memcpy --mode=bw --block=65536 --batch=16 --iters=256 --warmup=16
check read_bw bw memcpy --mode=bw --op=read --block=4096 --batch=8 --iters=64 --warmup=8
check threads bw memcpy --mode=bw --block=4096 --batch=8 --threads=2 --iters=256 --warmup=8
check latency lat memcpy --mode=lat --block=8 --iters=50 --warmup=5
check rounds bw memcpy --mode=bw --block=65536 --batch=8 --iters=64 --warmup=8 --rounds=3
check socket_ref bw socket --mode=bw --block=65536 --batch=8 --iters=64 --warmup=8 --reference=socket
check no_ref lat none --mode=lat --block=64 --iters=20 --warmup=2 --reference=none
# Scattered blocks by default, adjacent with --noscatter; the output says which.
for layout in scattered adjacent; do
  args=(--mode=bw --block=4096 --batch=8 --iters=64 --warmup=8)
  [[ $layout == adjacent ]] && args+=(--noscatter)
  out="$("$bench" --transport=tcp "${args[@]}" 2>&1)"
  if grep -q "^WRITE 4096 B x 64, $layout, over tcp" <<<"$out" &&
     grep -q "^RESULT mode=bw op=write block=4096 layout=$layout value=" <<<"$out" &&
     "$bench" --transport=tcp "${args[@]}" --json 2>&1 | grep -q "\"layout\": \"$layout\""; then
    echo "ok   $layout blocks are named"
  else
    echo "FAIL $layout blocks: $out"; fail=1
  fi
done
check prepared_latency lat memcpy --mode=lat --prepared --block=8 --iters=50 --warmup=5
if "$bench" --transport=tcp --mode=lat --prepared --block=8 --iters=20 --warmup=2 2>&1 |
    grep -q '^WRITE 8 B ping-pong (prepared transfers) x 20 '; then
  echo "ok   the prepared ping-pong says so"
else
  echo "FAIL the prepared ping-pong does not say so"; fail=1
fi
# --duration: a progress line per second, then the summary.
out="$("$bench" --transport=tcp --mode=bw --block=4096 --batch=8 --duration=2.5 --reference=none 2>&1)"
if [[ "$(grep -c '^\[  *[0-9]* s\] engine 4096 B: .* GB/s' <<<"$out")" -ge 2 ]] && grep -q '^RESULT mode=bw' <<<"$out"; then
  echo "ok   duration with progress lines"
else
  echo "FAIL duration: $out"; fail=1
fi
# --json: one parseable object per measure, with the reference.
for mode in bw lat; do
  out="$("$bench" --transport=tcp --mode=$mode --block=4096 --batch=8 --iters=64 --warmup=8 --json 2>&1)"
  if python3 -c 'import json, sys; d = json.loads(sys.argv[1]); assert d["mode"] == sys.argv[2]
assert d["reference"] == "memcpy" and d["ratio"] > 0
assert (d["mib_per_s"] > 0 and d["batch_us_p99"] >= d["batch_us_p50"] > 0) if d["mode"] == "bw" else (d["one_way_us_p999"] >= d["one_way_us_p50"] > 0)' "$out" "$mode"; then
    echo "ok   json $mode: $out"
  else
    echo "FAIL json $mode: $out"; fail=1
  fi
done
# --prepared: a row per block x batch, nixlbench's columns, figures > 0;
# --json: one object per row.
out="$("$bench" --transport=tcp --prepared --sweep=4096,65536 --batches=1,8 --iters=20 --warmup=2 --scatter 2>&1)"
rows="$(grep -cE '^(4096|65536) +(1|8) +[0-9]+ +[0-9.]+' <<<"$out")"
if [[ "$rows" == 4 ]] && grep -q 'scattered blocks' <<<"$out" && grep -q 'Avg Post (us)' <<<"$out" &&
   awk '/^(4096|65536) /{if (!($4 > 0 && $5 > 0 && $8 > 0 && $12 > 0 && $13 > 0)) exit 1}' <<<"$out"; then
  echo "ok   prepared sweep"
else
  echo "FAIL prepared: $out"; fail=1
fi
out="$("$bench" --transport=tcp --prepared --block=4096 --batches=16 --iters=20 --warmup=2 --noscatter --json 2>&1)"
if python3 -c 'import json, sys; d = json.loads(sys.argv[1]); assert d["mode"] == "prepared"
assert d["batch"] == 16 and d["descriptors"] == 1 and d["layout"] == "adjacent"
assert d["gb_s"] > 0 and d["post_p99_us"] >= 0 and d["tx_us"] > 0
assert d["reference"] == "memcpy" and d["reference_gb_s"] > 0 and d["ratio"] > 0' "$out"; then
  echo "ok   prepared json (16 adjacent blocks merge into 1): $out"
else
  echo "FAIL prepared json: $out"; fail=1
fi
# Two processes: a target, then initiators that find it by host:port and
# measure against the target's raw socket sink.
start_target() {  # start_target LOG ARGS...: sets $target and $addr
  local log="$1"; shift
  "$bench" --role=target --transport=tcp --host=127.0.0.1 --buffer_mib=16 "$@" >"$log" 2>&1 &
  target=$!
  for _ in $(seq 100); do grep -q "target ready at" "$log" && break; sleep 0.1; done
  addr="$(sed -n 's/^target ready at \([^ ]*\) .*/\1/p' "$log")"
  [[ -n "$addr" ]] || { echo "FAIL target did not start: $(cat "$log")"; fail=1; }
}
start_target "$tmp/target.log" --forever
if [[ -n "$addr" ]]; then
  check two_process_bw bw socket --role=initiator --peer="$addr" --host=127.0.0.1 --mode=bw \
    --block=65536 --batch=8 --iters=128 --warmup=8
  check two_process_lat lat socket --role=initiator --peer="$addr" --host=127.0.0.1 --mode=lat \
    --block=8 --iters=50 --warmup=5
  check two_process_prepared_lat lat socket --role=initiator --peer="$addr" --host=127.0.0.1 \
    --mode=lat --prepared --block=8 --iters=50 --warmup=5
  out="$("$bench" --role=initiator --peer="$addr" --host=127.0.0.1 --transport=tcp --block=$((8 << 20)) --batch=8 2>&1)"
  if [[ $? -ne 0 ]] && grep -q "larger --buffer_mib" <<<"$out"; then
    echo "ok   a target too small is named: $out"
  else
    echo "FAIL a target too small: $out"; fail=1
  fi
  kill $target; wait $target 2>/dev/null
fi
# Without --forever the target exits once an initiator says it is done.
start_target "$tmp/target2.log"
if [[ -n "$addr" ]]; then
  check done_bw bw socket --role=initiator --peer="$addr" --host=127.0.0.1 --block=4096 \
    --batch=8 --iters=64 --warmup=8
  for _ in $(seq 50); do kill -0 $target 2>/dev/null || break; sleep 0.1; done
  if kill -0 $target 2>/dev/null; then
    echo "FAIL the target still runs after the initiator was done"; fail=1; kill $target
  else
    echo "ok   target exited when the initiator was done"
  fi
fi
wait 2>/dev/null
# Sweep: CSV with a row per block (engine and reference figures), and a PNG.
out="$("$bench" --transport=tcp --sweep=4096,65536 --batch=8 --duration=0.2 --warmup=4 --out="$tmp/sweep" 2>&1)"
if python3 - "$tmp/sweep.csv" <<'EOF' && [[ "$(head -c 8 "$tmp/sweep.png" | od -An -tx1 | tr -d ' \n')" == 89504e470d0a1a0a ]]; then
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [int(r["block_bytes"]) for r in rows] == [4096, 65536], rows
for r in rows:
    for k in ("engine_gb_per_s", "reference_gb_per_s", "bw_ratio", "engine_lat_us_p50", "reference_lat_us_p50"):
        assert float(r[k]) > 0, (k, r)
EOF
  echo "ok   sweep wrote CSV and PNG"
else
  echo "FAIL sweep: $out"; ls -l "$tmp"; fail=1
fi
for bad in "--mode=fast" "--op=copy" "--role=server" "--sweep=4k" "--reference=perftest" "--threads=0" \
    "--prepared --batches=0" "--prepared --batches=default"; do
  if out="$("$bench" --transport=tcp --iters=10 $bad 2>&1)"; then
    echo "FAIL $bad was accepted: $out"; fail=1
  elif ! grep -q "must be\|not a block size\|not a batch size\|must be auto" <<<"$out"; then
    echo "FAIL $bad: no clear message: $out"; fail=1
  else
    echo "ok   $bad rejected: $out"
  fi
done
if out="$("$bench" --transport=sim 2>&1)" || ! grep -q "scale_benchmark" <<<"$out"; then
  echo "FAIL --transport=sim: $out"; fail=1
else
  echo "ok   --transport=sim points to the simulator's benchmarks: $out"
fi
if out="$("$bench" --role=initiator 2>&1)" || ! grep -q "needs --peer" <<<"$out"; then
  echo "FAIL initiator without --peer: $out"; fail=1
else
  echo "ok   initiator without --peer: $out"
fi
exit $fail
