#!/usr/bin/env bash
# Runs every handshake fuzzer for a bounded time on a copy of its seed
# corpus, as CI does:
#
#   tools/fuzz.sh [--seconds=N] [--log=FILE]
#
# Builds //handshake/fuzz:*_fuzzer with --config=fuzz (clang, libFuzzer,
# ASan, UBSan). For each fuzzer prints a GoogleTest-style result line
# ("[       OK ] fuzz.frame_fuzzer (... ms)" with the number of executions,
# or "[  FAILED  ]" with the crashing input), which .ci/run counts. A crash
# input is kept under the output directory; add it to
# handshake/fuzz/regressions/<fuzzer>/ with the fix, and the corpus test
# replays it in every build from then on.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=60
log=/dev/null
for a in "$@"; do
  case "$a" in
    --seconds=*) seconds="${a#--seconds=}" ;;
    --log=*) log="${a#--log=}" ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --seconds must be a positive number" >&2; exit 2; }
fuzzers=(frame descriptor auth hello data vmm_reply vmm_request)
targets=()
for f in "${fuzzers[@]}"; do targets+=("//handshake/fuzz:${f}_fuzzer"); done
if ! ./bazelw build --config=fuzz "${targets[@]}" --color=no --curses=no; then
  for f in "${fuzzers[@]}"; do echo "[  FAILED  ] fuzz.${f}_fuzzer (0 ms) build failed" | tee -a "$log"; done
  exit 1
fi
bin="$(./bazelw info --config=fuzz bazel-bin 2>/dev/null)/handshake/fuzz"
work="$(mktemp -d -t kvferry-fuzz.XXXXXX)"
status=0
for f in "${fuzzers[@]}"; do
  mkdir -p "$work/$f/corpus" "$work/$f/crashes"
  cp handshake/fuzz/corpus/"$f"/* "$work/$f/corpus/"
  start=$SECONDS
  "$bin/${f}_fuzzer" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$work/$f/crashes/" "$work/$f/corpus" >"$work/$f/log" 2>&1
  rc=$?
  ms=$(((SECONDS - start) * 1000))
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$f/log")"
  if ((rc == 0)); then
    echo "[       OK ] fuzz.${f}_fuzzer (${ms} ms) ${runs:-?} executions, no crash" | tee -a "$log"
  else
    status=1
    tail -30 "$work/$f/log"
    echo "[  FAILED  ] fuzz.${f}_fuzzer (${ms} ms) crash input(s): $(ls "$work/$f/crashes")" \
      "under $work/$f/crashes" | tee -a "$log"
  fi
done
exit "$status"
