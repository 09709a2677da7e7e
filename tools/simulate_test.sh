#!/usr/bin/env bash
# End-to-end check of //tools:simulate: it verifies the bytes it moved, the
# same seed prints the same trace hash, and bad flags give a clear error.
set -euo pipefail
sim="$TEST_SRCDIR/$TEST_WORKSPACE/tools/simulate"

out1="$("$sim" --seed=5 --bytes=4194304 --block=65536 --drop=1/100 --delay=1/10)"
out2="$("$sim" --seed=5 --bytes=4194304 --block=65536 --drop=1/100 --delay=1/10)"
echo "$out1"
grep -q "bytes verified   yes" <<<"$out1"
[[ "$(grep 'trace hash' <<<"$out1")" == "$(grep 'trace hash' <<<"$out2")" ]]
dropped="$(sed -n 's/.* sent, \([0-9]*\) dropped/\1/p' <<<"$out1")"
(( dropped > 0 )) || { echo "expected drops at 1/100"; exit 1; }

read_out="$("$sim" --op=read --bytes=1048576 --block=4096)"
grep -q "bytes verified   yes" <<<"$read_out"

# A lossless link with deep queues runs near the link rate.
fast="$("$sim" --bytes=16777216 --block=1048576 --depth=8)"
pct="$(sed -n 's/.*(\([0-9]*\)\.[0-9]*% of the.*/\1/p' <<<"$fast")"
(( pct >= 90 )) || { echo "goodput only ${pct}% of the link"; exit 1; }

if "$sim" --drop=oops 2>err.txt; then echo "bad --drop accepted"; exit 1; fi
grep -q -- "--drop must be N/D" err.txt
echo "simulate_test: ok"
