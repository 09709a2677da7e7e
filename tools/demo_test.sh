#!/usr/bin/env bash
# The demo end to end, small: two processes, every page verified; and the
# split-role mode with a decode process started first.
set -euo pipefail
demo="$TEST_SRCDIR/$TEST_WORKSPACE/tools/demo"
small=(--layers=4 --pool_pages=32 --requests=3 --pages=8 --host=127.0.0.1)
# Runs the demo, small, with more flags; its output in $out.
run() { out="$("$demo" "${small[@]}" "$@")"; echo "$out"; }

run
grep -q "OK: every page arrived intact." <<<"$out"
grep -q "verified 192/192" <<<"$out"
grep -q "3 concurrent requests" <<<"$out"
grep -q "transport tcp" <<<"$out"

# Cancelling a request mid-way: both processes see it fail, the rest arrive.
run --cancel_last
grep -q "verified 128/128, 1 request seen cancelled" <<<"$out"
grep -q "OK: every page arrived intact." <<<"$out"

# A prefill killed mid-request: the decode reports every request failed,
# says how long it took, and then serves a second prefill.
run --kill_prefill_after=2
grep -q "now it dies (SIGKILL)" <<<"$out"
grep -q "all 3 requests reported failed .* ms after its death (UNAVAILABLE: the prefill at" <<<"$out"
grep -q "verified 192/192" <<<"$out"
grep -q "OK: every page arrived intact." <<<"$out"
if "$demo" "${small[@]}" --kill_prefill_after=4 2>err.txt >/dev/null; then
  echo "killing after every layer accepted"; exit 1
fi
grep -q -- "--kill_prefill_after needs" err.txt

# Two separate invocations, as on two machines.
log="$TEST_TMPDIR/decode.log"
"$demo" --role=decode "${small[@]}" >"$log" 2>&1 &
decode=$!
for _ in $(seq 100); do grep -q -- "--peer=" "$log" && break; sleep 0.1; done
peer="$(sed -n 's/.*--peer=\([^ ]*\).*/\1/p' "$log")"
# The prefill side gets nothing but host:port.
"$demo" --role=prefill --peer="$peer" "${small[@]}" | tee "$TEST_TMPDIR/prefill.log"
grep -q "OK: every page arrived intact." "$TEST_TMPDIR/prefill.log"
wait "$decode"

if "$demo" --role=prefill 2>err.txt; then echo "prefill without --peer accepted"; exit 1; fi
grep -q -- "--peer=HOST:PORT" err.txt
if "$demo" --requests=99 --pool_pages=32 2>err.txt >/dev/null; then echo "oversized plan accepted"; exit 1; fi
grep -q -- "--requests x --pages" err.txt
echo "demo_test: ok"
