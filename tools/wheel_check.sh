#!/usr/bin/env bash
# Installs kvferry's wheel into a fresh virtual environment, as a new user
# would, and runs the Mooncake-style scripts from there: the wheel, pip and
# the opt-in `mooncake.engine` stand-in, nothing from the source tree on the
# path. One GoogleTest-style result line per check (for tools/test_summary.py).
#
#   tools/wheel_check.sh [--log=FILE]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log=/dev/stdout
for arg in "$@"; do
  case "$arg" in
    --log=*) log="${arg#--log=}" ;;
    *) echo "usage: $0 [--log=FILE]" >&2; exit 2 ;;
  esac
done
: >"$log"
status=0
work="$(mktemp -d -t kvferry-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# result NAME START_SECONDS RC
result() {
  local ms=$(( (SECONDS - $2) * 1000 ))
  if [[ "$3" == 0 ]]; then
    echo "[       OK ] wheel.$1 ($ms ms)" | tee -a "$log"
  else
    echo "[  FAILED  ] wheel.$1 ($ms ms)" | tee -a "$log"
    status=1
  fi
}

start=$SECONDS
./bazelw build //python:wheel --color=no --curses=no --show_progress_rate_limit=60 &&
  whl="$(ls bazel-bin/python/kvferry-*-py3-none-linux_x86_64.whl | head -n1)" &&
  python3 -m venv "$work/venv" &&
  "$work/venv/bin/pip" install --no-index --quiet "$whl" &&
  (cd "$work" && venv/bin/python -c "import kvferry, kvferry_compat") &&
  (cd "$work" && venv/bin/python -m kvferry_compat install)
rc=$?
result install "$start" "$rc"
((rc == 0)) || exit 1

# The scripts run from a directory of their own: only the venv provides
# kvferry and mooncake.
cp python/mooncake_style/*.py "$work/"
hosts=(127.0.0.1) names=(ipv4)
if python3 -c 'import socket; s = socket.socket(socket.AF_INET6); s.bind(("::1", 0))' 2>/dev/null; then
  hosts+=("::1" "[::1]") names+=(ipv6_bare ipv6_bracketed)
else
  echo "wheel: no IPv6 loopback here; IPv6 hosts not tried" | tee -a "$log"
fi
# SGLang's default protocol is rdma: without an RDMA device it falls back to
# TCP (one warning), as Mooncake does.
start=$SECONDS
(cd "$work" && KVFERRY_LOG_LEVEL=warning timeout 300 venv/bin/python every_method.py \
  --protocol rdma) >>"$log" 2>&1
result every_method_rdma_or_its_fallback "$start" $?
for i in "${!hosts[@]}"; do
  start=$SECONDS
  (cd "$work" && KVFERRY_LOG_LEVEL=warning timeout 300 venv/bin/python every_method.py \
    --host "${hosts[$i]}") >>"$log" 2>&1
  result "every_method_${names[$i]}" "$start" $?
done

# The stand-in never shadows a real Mooncake.
start=$SECONDS
mkdir -p "$work/real/mooncake" && echo "# a real Mooncake" >"$work/real/mooncake/__init__.py"
if (cd "$work" && venv/bin/python -m kvferry_compat install --target "$work/real") >>"$log" 2>&1; then
  rc=1
else
  [[ "$(cat "$work/real/mooncake/__init__.py")" == "# a real Mooncake" ]]
  rc=$?
fi
result refuses_to_shadow_a_real_mooncake "$start" "$rc"
exit "$status"
