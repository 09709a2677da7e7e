#!/usr/bin/env bash
# The engine against perftest and UCX on the same Soft-RoCE device, in one
# VM boot:
#
#   tools/softroce/bench.sh [--rounds=N] [--against=TRANSFER_BENCH]
#
# Builds //bench:transfer_bench (-c opt), boots the VM (tools/softroce/vm.sh)
# and runs, alternating, N rounds (default 3) of: ib_write_bw, the engine
# and ucx_perftest ucp_put_bw with 64 KiB WRITEs; ib_write_lat, the engine
# and ucp_put_lat with 8 B (one-way latency, half a ping-pong); ib_write_bw
# and the engine with 4 KiB WRITEs; and the engine's prepared transfers
# (transfer_bench --prepared: 64 scattered 64 KiB blocks, or 256 of 4 KiB,
# per post, one post in flight; and the 8 B ping-pong posting one prepared
# transfer again and again) against the same perftest figures.
# Prints the medians and the median of the per-round ratios to perftest. Timings under TCG are noisy: run it on a
# quiet host and compare ratios, not absolute figures. --against ships
# another build's transfer_bench (an earlier commit's, say) and runs it
# right after this one's in every round: its rows are the "reference
# build" columns, side by side in the same boot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rounds=3
against=""
for a in "$@"; do
  case "$a" in
    --rounds=*) rounds="${a#--rounds=}" ;;
    --against=*) against="${a#--against=}" ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: --rounds must be a positive number" >&2; exit 2; }
./bazelw build -c opt //bench:transfer_bench >&2
bin="$(./bazelw info -c opt bazel-bin 2>/dev/null)/bench/transfer_bench"
log="$(mktemp)"
ref_dir="$(mktemp -d)"
trap 'rm -rf "$log" "$ref_dir"' EXIT
ship=(--file="$bin")
if [[ -n "$against" ]]; then
  [[ -x "$against" ]] || { echo "bench.sh: $against is not an executable" >&2; exit 2; }
  cp "$against" "$ref_dir/transfer_bench_ref"
  ship+=(--file="$ref_dir/transfer_bench_ref")
fi
KVFERRY_VM_APPEND="kvf_rounds=$rounds" tools/softroce/vm.sh --timeout=$((300 + rounds * 420)) \
  "${ship[@]}" tools/softroce/bench_in_vm.sh | tee "$log" | grep -a "^BENCH\|^bench:" >&2 || true
python3 - "$log" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1], errors="replace"):
    f = line.split()
    if len(f) == 4 and f[0] == "BENCH":
        rows.setdefault(f[2], {})[int(f[1])] = float(f[3])
def med(name):
    v = [x for x in rows.get(name, {}).values() if x == x]
    return statistics.median(v) if v else float("nan")
def ratio(name, ref):
    a, b = rows.get(name, {}), rows.get(ref, {})
    r = [a[k] / b[k] for k in a if k in b and a[k] == a[k] and b[k] == b[k] and b[k] > 0]
    return statistics.median(r) if r else float("nan")
against = any(k.endswith("_ref") for k in rows)
head = "| measure | perftest | kvferry | ratio | UCX | ratio |"
if against:
    head += " reference build | ratio |"
print(head)
print("|" + "---|" * (head.count("|") - 1))
for label, ref, eng, ucx in [
        ("64 KiB WRITE, MiB/s", "ib_write_bw", "engine_write_bw", "ucx_put_bw"),
        ("8 B WRITE one-way latency, us", "ib_write_lat", "engine_write_lat", "ucx_put_lat"),
        ("8 B prepared WRITE one-way latency, us", "ib_write_lat", "engine_prepared_lat", None),
        ("4 KiB WRITE, MiB/s", "ib_write_bw_4k", "engine_write_bw_4k", None),
        ("64 KiB prepared WRITE (64 per post), MiB/s", "ib_write_bw", "engine_prepared_bw", None),
        ("4 KiB prepared WRITE (256 per post), MiB/s", "ib_write_bw_4k", "engine_prepared_bw_4k",
         None)]:
    u = f"{med(ucx):.1f} | {ratio(ucx, ref):.2f}" if ucx else "- | -"
    line = f"| {label} | {med(ref):.1f} | {med(eng):.1f} | {ratio(eng, ref):.2f} | {u} |"
    if against:
        line += f" {med(eng + '_ref'):.1f} | {ratio(eng + '_ref', ref):.2f} |"
    print(line)
rounds = max((len(v) for v in rows.values()), default=0)
print(f"({rounds} round(s) in one VM boot; ratio = median of per-round ratios to perftest)")
PY
