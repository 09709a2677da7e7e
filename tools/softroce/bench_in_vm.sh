#!/bin/sh
# Runs inside the Soft-RoCE VM (shipped by tools/softroce/bench.sh): the
# engine's transfer_bench and its references on the same rxe0 device,
# alternating, ROUNDS times. Prints "BENCH <round> <name> <value>" lines.
B=/t/transfer_bench
ROUNDS=$(sed -n 's/.*kvf_rounds=\([0-9]*\).*/\1/p' /proc/cmdline)
ROUNDS=${ROUNDS:-3}
GID=1  # ::ffff:127.0.0.1 on rxe0 over lo
export UCX_TLS=rc_verbs,ud_verbs UCX_NET_DEVICES=rxe0:1 UCX_IB_GID_INDEX=$GID \
  UCX_UD_VERBS_ETH_DGID_CHECK=n
PT="-d rxe0 -x $GID -F"

# pair NAME AWK_PROGRAM SERVER_CMD... -- CLIENT_CMD...: a server in the
# background, the client after it, the figure from the client's output.
pair() {
  name=$1; prog=$2; shift 2
  server=""
  while [ "$1" != "--" ]; do server="$server $1"; shift; done
  shift
  # Both sides bounded: a server whose client failed would wait for ever.
  timeout 150 $server >/tmp/server.log 2>&1 &
  spid=$!
  sleep 1
  v=$(timeout 120 "$@" 2>&1 | tee /tmp/client.log | awk "$prog")
  wait $spid
  [ -n "$v" ] || { echo "bench: $name gave no figure:"; tail -5 /tmp/client.log; }
  echo "BENCH $r $name ${v:-nan}"
}
engine() {
  name=$1; shift
  v=$(timeout 150 $B --transport=rdma "$@" 2>/tmp/engine.log | sed -n 's/^RESULT .*value=\([0-9.]*\).*/\1/p')
  [ -n "$v" ] || { echo "bench: $name failed:"; tail -5 /tmp/engine.log; }
  echo "BENCH $r $name ${v:-nan}"
  # Another build's binary (bench.sh --against), right after: side by side.
  if [ -x /t/transfer_bench_ref ]; then
    v=$(timeout 150 /t/transfer_bench_ref --transport=rdma "$@" 2>/tmp/engine.log |
      sed -n 's/^RESULT .*value=\([0-9.]*\).*/\1/p')
    [ -n "$v" ] || { echo "bench: ${name}_ref failed:"; tail -5 /tmp/engine.log; }
    echo "BENCH $r ${name}_ref ${v:-nan}"
  fi
}

# A prepared transfer (this build only: an older one may lack --prepared):
# `batch` scattered blocks posted again and again, one post in flight.
prepared() {
  name=$1; shift
  v=$(timeout 150 $B --transport=rdma --prepared --scatter "$@" 2>/tmp/engine.log |
    sed -n 's/^RESULT .*value=\([0-9.]*\).*/\1/p')
  [ -n "$v" ] || { echo "bench: $name failed:"; tail -5 /tmp/engine.log; }
  echo "BENCH $r $name ${v:-nan}"
}

# The engine's bw runs use --scatter: one work request per block, as
# perftest and UCX post them (adjacent blocks would share slices).
r=1
while [ "$r" -le "$ROUNDS" ]; do
  pair ib_write_bw '$1 == 65536 {print $4}' \
    /usr/bin/ib_write_bw $PT -s 65536 -n 2000 -- /usr/bin/ib_write_bw $PT -s 65536 -n 2000 127.0.0.1
  engine engine_write_bw --mode=bw --block=65536 --batch=64 --iters=2000 --scatter
  prepared engine_prepared_bw --block=65536 --batches=64 --iters=32 --warmup=2
  pair ucx_put_bw '/^Final:/ {print $6}' \
    /usr/bin/ucx_perftest -p 13337 -t ucp_put_bw -s 65536 -n 2000 -- \
    /usr/bin/ucx_perftest 127.0.0.1 -p 13337 -t ucp_put_bw -s 65536 -n 2000
  pair ib_write_lat '$1 == 8 {print $5}' \
    /usr/bin/ib_write_lat $PT -s 8 -n 2000 -- /usr/bin/ib_write_lat $PT -s 8 -n 2000 127.0.0.1
  engine engine_write_lat --mode=lat --block=8 --iters=2000
  prepared engine_prepared_lat --mode=lat --block=8 --iters=2000
  pair ucx_put_lat '/^Final:/ {print $3}' \
    /usr/bin/ucx_perftest -p 13338 -t ucp_put_lat -s 8 -n 2000 -- \
    /usr/bin/ucx_perftest 127.0.0.1 -p 13338 -t ucp_put_lat -s 8 -n 2000
  pair ib_write_bw_4k '$1 == 4096 {print $4}' \
    /usr/bin/ib_write_bw $PT -s 4096 -n 5000 -- /usr/bin/ib_write_bw $PT -s 4096 -n 5000 127.0.0.1
  engine engine_write_bw_4k --mode=bw --block=4096 --batch=64 --iters=5000 --scatter
  prepared engine_prepared_bw_4k --block=4096 --batches=256 --iters=20 --warmup=2
  r=$((r + 1))
done
