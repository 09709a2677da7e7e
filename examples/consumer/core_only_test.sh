#!/usr/bin/env bash
set -euo pipefail
out="$("$TEST_SRCDIR/$TEST_WORKSPACE/core_only")"
echo "$out"
grep -q "refused" <<<"$out"
