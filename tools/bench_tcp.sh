#!/usr/bin/env bash
# The engine over TCP against a raw socket stream and UCX's TCP transport,
# between two processes on this host, in one run:
#
#   tools/bench_tcp.sh [--rounds=N] [--blocks=65536,1048576] [--layouts=scattered,adjacent]
#                      [--pin]
#
# Builds //bench:transfer_bench (-c opt), starts a target process, and runs,
# alternating, N rounds (default 3) per block size of: the engine
# (transfer_bench --role=initiator, which measures the raw socket stream to
# the target's sink alternately with it, five times 0.2 s each) with
# scattered blocks (every other block on both ends, as a KV cache's pages:
# each request its own slice),
# then with adjacent ones (which the engine moves in shared slices), and
# ucx_perftest ucp_put_bw with UCX_TLS=tcp. Prints the medians and the
# median of the per-round ratios to the raw socket stream, a row per block
# and layout. --layouts picks them (default both). Installs ucx-utils
# (apt) when ucx_perftest is missing and this runs as root. Compare
# ratios, not absolute figures. --pin gives the target's side (the target
# process, UCX's server) one half of this process's CPUs and the
# initiator's side the other, as two hosts would have (default: both share
# them all); the raw stream's ends live in the same two processes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=3
blocks=65536,1048576
layouts=scattered,adjacent
pin=0
for a in "$@"; do
  case "$a" in
    --rounds=*) rounds="${a#--rounds=}" ;;
    --blocks=*) blocks="${a#--blocks=}" ;;
    --layouts=*) layouts="${a#--layouts=}" ;;
    --pin) pin=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench_tcp.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "bench_tcp.sh: --rounds must be a positive number" >&2; exit 2; }
[[ "$blocks" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "bench_tcp.sh: --blocks is a comma-separated list of byte counts" >&2; exit 2; }
[[ "$layouts" =~ ^(scattered|adjacent)(,(scattered|adjacent))?$ ]] || { echo "bench_tcp.sh: --layouts is scattered, adjacent or both (comma-separated)" >&2; exit 2; }
if ! command -v ucx_perftest >/dev/null; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get install -y -q --no-install-recommends ucx-utils >&2 ||
      { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends ucx-utils >&2; }
  else
    echo "bench_tcp.sh: ucx_perftest not found; install ucx-utils" >&2; exit 2
  fi
fi
# The commands that start each side's processes: plain, or (--pin) under
# taskset on its half of the CPUs.
on_target=()
on_initiator=()
if [[ $pin == 1 ]]; then
  read -r lower upper < <(python3 -c 'import os
c = sorted(os.sched_getaffinity(0))
h = len(c) // 2
print(",".join(map(str, c[:h])) or "-", ",".join(map(str, c[h:])))')
  [[ "$lower" != - ]] || { echo "bench_tcp.sh: --pin needs at least 2 CPUs" >&2; exit 2; }
  command -v taskset >/dev/null || { echo "bench_tcp.sh: --pin needs taskset (util-linux)" >&2; exit 2; }
  on_target=(taskset -c "$upper")
  on_initiator=(taskset -c "$lower")
  echo "bench_tcp.sh: target side on CPUs $upper, initiator side on CPUs $lower" >&2
fi
./bazelw build -c opt //bench:transfer_bench >&2
bin="$(./bazelw info -c opt bazel-bin 2>/dev/null)/bench/transfer_bench"
work="$(mktemp -d)"
target_pid=""
trap '[[ -n "$target_pid" ]] && kill "$target_pid" 2>/dev/null; rm -rf "$work"' EXIT
"${on_target[@]}" "$bin" --role=target --transport=tcp --host=127.0.0.1 --forever --buffer_mib=64 >"$work/target.log" 2>&1 &
target_pid=$!
for _ in $(seq 100); do grep -q "target ready at" "$work/target.log" && break; sleep 0.1; done
peer="$(sed -n 's/^target ready at \([^ ]*\) .*/\1/p' "$work/target.log")"
[[ -n "$peer" ]] || { echo "bench_tcp.sh: the target did not start: $(cat "$work/target.log")" >&2; exit 1; }
port=13400
IFS=, read -r -a sizes <<<"$blocks"
IFS=, read -r -a kinds <<<"$layouts"
for ((r = 1; r <= rounds; r++)); do
  for b in "${sizes[@]}"; do
    for layout in "${kinds[@]}"; do
      # The engine, then the raw socket stream (the tool measures both).
      flag=--scatter
      [[ "$layout" == adjacent ]] && flag=--noscatter
      # Five alternations of 0.2 s each: a host that slows down for a
      # second slows both sides of the ratio (the round's ratio is the
      # median of the five).
      json="$("${on_initiator[@]}" "$bin" --role=initiator --peer="$peer" --host=127.0.0.1 --transport=tcp --json \
              --block="$b" --batch=16 "$flag" --duration=0.2 --rounds=5 --warmup=32 \
              --reference=socket 2>/dev/null || true)"
      python3 -c 'import json, sys
d = json.loads(sys.argv[1]); r, b, l = sys.argv[2], sys.argv[3], sys.argv[4]
assert d["layout"] == l, d["layout"]
print("BENCH", r, b, "kvferry-" + l, d["gb_per_s"])
print("BENCH", r, b, "socket-" + l, d["reference_gb_per_s"])
print("BENCH", r, b, "ratio-" + l, d["ratio"])' \
        "$json" "$r" "$b" "$layout" 2>/dev/null || echo "BENCH $r $b kvferry-$layout nan"
    done
    # UCX over TCP, the same block size, as many bytes as a second of the engine.
    port=$((port + 1))
    iters=$(( (1 << 31) / b ))
    UCX_TLS=tcp,self "${on_target[@]}" timeout 120 ucx_perftest -p "$port" -t ucp_put_bw -s "$b" -n "$iters" \
      >"$work/ucx_server.log" 2>&1 &
    spid=$!
    sleep 0.5
    v="$(UCX_TLS=tcp,self "${on_initiator[@]}" timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw -s "$b" \
          -n "$iters" 2>&1 | awk '/^Final:/ {print $6}')"
    wait "$spid" 2>/dev/null || true
    # ucx_perftest reports MB/s of 2^20 bytes.
    python3 -c 'import sys; v = sys.argv[1]; print("BENCH", sys.argv[2], sys.argv[3], "ucx", float(v) * 1048576 / 1e9 if v else "nan")' \
      "$v" "$r" "$b"
  done
done | tee "$work/rows" >&2
python3 - "$work/rows" "$pin" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 5 and f[0] == "BENCH":
        rows.setdefault((int(f[2]), f[3]), {})[int(f[1])] = float(f[4])
blocks = sorted({b for b, _ in rows})
def med(v):
    v = [x for x in v if x == x]
    return statistics.median(v) if v else float("nan")
layouts = [l for l in ("scattered", "adjacent") if any(n == "kvferry-" + l for _, n in rows)]
print("| block | layout | raw socket GB/s | kvferry GB/s | ratio | UCX tcp GB/s | ratio |")
print("|---|---|---|---|---|---|---|")
for b in blocks:
    for l in layouts:
        sock, mine = rows.get((b, "socket-" + l), {}), rows.get((b, "kvferry-" + l), {})
        ucx = rows.get((b, "ucx"), {})
        ratio = lambda x: med([x[r] / sock[r] for r in x if r in sock and sock[r] > 0])
        # kvferry's per-round ratio is the tool's own (the median of its
        # alternations); UCX's is against the raw stream of the same round.
        mine_ratio = med(rows.get((b, "ratio-" + l), {}).values())
        print(f"| {b} | {l} | {med(sock.values()):.2f} | {med(mine.values()):.2f} | "
              f"{mine_ratio:.2f} | {med(ucx.values()):.2f} | {ratio(ucx):.2f} |")
print(f"({len({r for v in rows.values() for r in v})} round(s); ratio = median of per-round ratios to the raw "
      "socket stream of the same row (kvferry's: each round five 0.2 s alternations, their median "
      "ratio); scattered: every other block on both ends, each request its own "
      "slice; adjacent: blocks that follow each other, moved in shared slices; UCX puts one "
      "contiguous buffer" + ("; --pin: each side on its own half of the CPUs)" if sys.argv[2] == "1"
                              else "; both sides share all CPUs)"))
PY
