#!/usr/bin/env bash
# //engine:core, //kv and the simulated world stand without the real
# transports: the binaries built from them alone, with every library they
# load, must not need an RDMA or CUDA library, nor contain the verbs
# transport, the verbs seam or the TCP transport and network (those come
# with //engine's creation only). Works for static and dynamic test links.
set -euo pipefail
runfiles="$TEST_SRCDIR/$TEST_WORKSPACE"
checked=0
for f in tests/sim_engine_test tests/sim_kv_test; do
  path="$runfiles/$f"
  [[ -e "$path" ]] || { echo "missing $f"; exit 1; }
  mapfile -t objects < <(echo "$path"; ldd "$path" | awk '/=>/ && $3 ~ /^\// {print $3}')
  engine=0
  for o in "${objects[@]}"; do
    if readelf -d "$o" | grep -E "NEEDED.*\[(libcuda\.so|libibverbs|librdmacm)"; then
      echo "FAIL: $o (loaded by $f) needs a CUDA or RDMA library"; exit 1
    fi
    case "$o" in /lib/*|/usr/lib/*|/lib64/*) continue ;; esac
    symbols=$(nm -C --defined-only "$o" 2>/dev/null; nm -C -D --defined-only "$o" 2>/dev/null) || true
    found=$(grep -E "kvferry::transport::(verbs|ibv)::|kvferry::transport::TcpTransport|kvferry::handshake::TcpServer|CreateTcpTransport|NewTcpNetwork" <<<"$symbols" | head -5 || true)
    if [[ -n "$found" ]]; then
      echo "FAIL: $o (loaded by $f) contains a real transport:"; echo "$found"; exit 1
    fi
    grep -q "kvferry::TransferEngine::CreateWith" <<<"$symbols" && engine=1
  done
  # The check sees the engine: binaries with no kvferry code would pass
  # for nothing.
  [[ $engine == 1 ]] || { echo "FAIL: no engine found in $f or its libraries"; exit 1; }
  checked=$((checked + 1))
done
echo "no RDMA library and no real transport in $checked binaries of the core and the KV layer"
