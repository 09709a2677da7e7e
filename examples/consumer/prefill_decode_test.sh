#!/usr/bin/env bash
set -euo pipefail
out="$("$TEST_SRCDIR/$TEST_WORKSPACE/prefill_decode")"
echo "$out"
grep -q "verified" <<<"$out"
