#!/usr/bin/env bash
# Installs kvferry's wheel where serving runs, not where it was built, and
# runs the Mooncake-style scripts and the Python tests' TCP cases there. One
# GoogleTest-style result line per check or test case (tools/test_summary.py
# counts them).
#
#   tools/wheel_check.sh [--log=FILE] [--only=NAME]   (the build's and the
#   tests' output go to FILE; without --log, to a temporary file it names)
#
# 1. Builds the self-contained wheel (tools/wheel.sh) and checks with
#    readelf that libkvferry.so needs glibc's libraries only (and
#    libgcc_s.so.1), at no symbol version above GLIBC_2.34.
# 2. This machine's python3, in a fresh virtual environment.
# 3. Fresh root filesystems made with debootstrap from Debian's archive, each
#    with a fresh virtual environment and `pip install --no-index`:
#      debian12  Debian 12 minbase + python3 (3.11): no rdma-core, no Abseil
#      debian13  Debian 13 + python3 (3.13) + rdma-core: discovery runs,
#                finds no device, and the engine says TCP and why
#      pypy3     Debian 12 minbase + Debian's pypy3 (no numpy there, so the
#                numpy-based test file is left out)
#    The root filesystems are cached in ${KVFERRY_CACHE:-~/.cache/kvferry}
#    (made once, about 40 s each, in parallel); they are never written to:
#    each run's venv and files live in a bind-mounted scratch directory.
#    Needs root (chroot); without it, step 3 is reported skipped.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"

log=""
only=""
for arg in "$@"; do
  case "$arg" in
    --log=*) log="${arg#--log=}" ;;
    --only=*) only="${arg#--only=}" ;;
    *) echo "usage: $0 [--log=FILE] [--only=debian12|debian13|pypy3|host]" >&2; exit 2 ;;
  esac
done
# Result lines go to stdout and the log; everything else to the log alone
# (without --log, a file of its own, named at the end).
[[ -n "$log" ]] || log="$(mktemp -t kvferry-wheel-log.XXXXXX)"
: >"$log"
status=0
work="$(mktemp -d -t kvferry-wheel.XXXXXX)"
mounts=()
cleanup() {
  local m
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
cache="${KVFERRY_CACHE:-$HOME/.cache/kvferry}/rootfs"
mirror="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | head -1)"
mirror="${mirror:-http://deb.debian.org/debian}"

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
skipped() { echo "[  SKIPPED ] wheel.$1 (0 ms)" | tee -a "$log"; }

# ------------------------------------------------------------- the wheel
start=$SECONDS
whl="$(tools/wheel.sh --color=no --curses=no --show_progress_rate_limit=60 2>>"$log")"
rc=$?
result build "$start" "$rc"
((rc == 0)) && [[ -f "$whl" ]] || exit 1
cp "$whl" "$work/"
whl="$work/$(basename "$whl")"

# What libkvferry.so needs: glibc's libraries (and libgcc_s.so.1, which
# glibc itself loads), no symbol version above GLIBC_2.34, nothing but the C
# API exported.
start=$SECONDS
(
  set -e
  mkdir -p "$work/lib" && cd "$work/lib" && python3 -m zipfile -e "$whl" . >/dev/null
  so=kvferry/libkvferry.so
  needed="$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')"
  echo "libkvferry.so NEEDED: $needed"
  for n in $needed; do
    case "$n" in
      libc.so.6|libm.so.6|libdl.so.2|libpthread.so.0|librt.so.1|ld-linux-x86-64.so.2|libgcc_s.so.1) ;;
      *) echo "libkvferry.so needs $n, which is not glibc's"; exit 1 ;;
    esac
  done
  newest="$(readelf -V "$so" | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n | tail -1)"
  echo "libkvferry.so newest glibc symbol version: $newest"
  [[ "${newest#GLIBC_2.}" -le 34 ]] || { echo "needs $newest, above GLIBC_2.34"; exit 1; }
  others="$(nm -D --defined-only "$so" | awk '$2 ~ /^[A-Zu]$/ && $2 != "A" && $3 !~ /^kvferry_/')"
  [[ -z "$others" ]] || { echo "exports more than the C API: $others"; exit 1; }
) >>"$log" 2>&1
result library_needs_glibc_only "$start" $?

# The tests and scripts, copied where nothing of the source tree is beside
# them: kvferry comes from the venv alone.
mkdir -p "$work/tests"
cp python/kvferry_test.py python/mooncake_compat_test.py python/mooncake_p2p_write.py \
  tools/pyunit_gtest.py "$work/tests/"
cp -r python/mooncake_style "$work/tests/"
cat >"$work/tests/run.sh" <<'EOS'
#!/bin/sh
# run.sh NAME PYTHON [TEST_FILE...]: a fresh venv, the wheel, the checks.
# Run from the scratch directory ($1: the result prefix).
name="$1" python="$2"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/../venv-$name"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
export KVFERRY_LOG_LEVEL=warning
line() { if [ "$2" = 0 ]; then echo "[       OK ] wheel.$name.$1 (0 ms)"; else echo "[  FAILED  ] wheel.$name.$1 (0 ms)"; fi; }
"$python" -m venv --system-site-packages "$venv" &&
  "$venv/bin/pip" install --no-index --quiet "$here"/../*.whl &&
  "$venv/bin/python" -m kvferry_compat install >/dev/null
rc=$?; line install $rc; [ $rc = 0 ] || exit 1
cd "$here"
# An automatic engine: which transport, and why (WANT_REASON, when set,
# must be part of the reason).
"$venv/bin/python" -c 'import kvferry, sys; e = kvferry.Engine(host="127.0.0.1"); d = e.detection(); print(sys.implementation.name, sys.version.split()[0], "kvferry", kvferry.__version__, "transport", d["transport"], "(" + d["transport_reason"] + ")")' >engine.txt
rc=$?; cat engine.txt
if [ $rc = 0 ] && [ -n "$WANT_REASON" ]; then grep -qF "$WANT_REASON" engine.txt; rc=$?; fi
line engine_says_tcp_and_why $rc
timeout 300 "$venv/bin/python" mooncake_style/every_method.py --protocol rdma
line every_method_rdma_or_its_fallback $?
timeout 300 "$venv/bin/python" mooncake_style/every_method.py --host 127.0.0.1
line every_method_ipv4 $?
if [ $# -gt 0 ]; then
  timeout 600 "$venv/bin/python" pyunit_gtest.py --prefix="wheel.$name" "$@"
fi
exit 0
EOS
chmod +x "$work/tests/run.sh"

# ----------------------------------------------------------- this machine
if [[ -z "$only" || "$only" == host ]]; then
  start=$SECONDS
  (cd "$work" && tests/run.sh host python3 kvferry_test.py mooncake_compat_test.py) >>"$log" 2>&1
  # The stand-in never shadows a real Mooncake.
  mkdir -p "$work/real/mooncake" && echo "# a real Mooncake" >"$work/real/mooncake/__init__.py"
  if (cd "$work" && venv-host/bin/python -m kvferry_compat install --target "$work/real") \
      >>"$log" 2>&1; then
    rc=1
  else
    [[ "$(cat "$work/real/mooncake/__init__.py")" == "# a real Mooncake" ]]
    rc=$?
  fi
  result refuses_to_shadow_a_real_mooncake "$start" "$rc"
fi

# ------------------------------------------------- fresh root filesystems
# rootfs NAME SUITE PACKAGES: the cached root filesystem's path, made if
# missing (the key names its suite and packages).
rootfs() {
  local name="$1" suite="$2" packages="$3"
  local key dir
  key="$(echo "$suite $packages" | sha256sum | cut -c1-12)"
  dir="$cache/$name-$key"
  if [[ ! -f "$dir/.complete" ]]; then
    rm -rf "$dir" && mkdir -p "$cache"
    if ! debootstrap --variant=minbase --include="$packages" "$suite" "$dir" "$mirror" \
        >"$cache/$name.log" 2>&1; then
      echo "debootstrap $name failed; see $cache/$name.log" >&2
      tail -5 "$cache/$name.log" >&2
      return 1
    fi
    mkdir -p "$dir/scratch"
    touch "$dir/.complete"
  fi
  echo "$dir"
}

# in_root DIR NAME WANT_REASON PYTHON TEST_FILES...: runs run.sh inside DIR.
in_root() {
  local dir="$1" name="$2" want="$3"; shift 3
  mount --bind "$work" "$dir/scratch" && mounts+=("$dir/scratch") || return 1
  mount -t proc proc "$dir/proc" && mounts+=("$dir/proc") || return 1
  mount --rbind /dev "$dir/dev" && mounts+=("$dir/dev") || return 1
  mount --rbind /sys "$dir/sys" && mounts+=("$dir/sys") || return 1
  chroot "$dir" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/scratch LANG=C.UTF-8 \
    WANT_REASON="$want" /bin/sh /scratch/tests/run.sh "$name" "$@"
  local rc=$?
  umount -l "$dir/sys" "$dir/dev" "$dir/proc" "$dir/scratch"
  return $rc
}

declare -A suite=([debian12]=bookworm [debian13]=trixie [pypy3]=bookworm)
declare -A packages=(
  [debian12]=python3,python3-venv,python3-numpy
  [debian13]=python3,python3-venv,python3-numpy,ibverbs-providers,rdmacm-utils
  [pypy3]=pypy3,pypy3-venv
)
declare -A python=([debian12]=python3 [debian13]=python3 [pypy3]=pypy3)
# Without rdma-core the engine names the missing library; with it (and no
# RDMA device, as in CI) discovery runs and finds none.
declare -A reason=(
  [debian12]="libibverbs.so.1 not found: RDMA unavailable"
  [debian13]="no RDMA devices on this host"
  [pypy3]="libibverbs.so.1 not found: RDMA unavailable"
)
declare -A tests=(
  [debian12]="kvferry_test.py mooncake_compat_test.py"
  [debian13]="kvferry_test.py mooncake_compat_test.py"
  [pypy3]="mooncake_compat_test.py"
)
names=()
for n in debian12 debian13 pypy3; do
  [[ -z "$only" || "$only" == "$n" ]] && names+=("$n")
done
if [[ "$(id -u)" != 0 ]] || ! command -v debootstrap >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap \
      >>"$log" 2>&1
  fi
fi
if [[ "$(id -u)" != 0 ]] || ! command -v debootstrap >/dev/null; then
  for n in "${names[@]}"; do skipped "$n.rootfs"; done
  echo "wheel: fresh root filesystems need root and debootstrap" | tee -a "$log"
  exit "$status"
fi

# Made in parallel (each is mostly waiting on the archive).
declare -A dirs=()
start=$SECONDS
for n in "${names[@]}"; do
  rootfs "$n" "${suite[$n]}" "${packages[$n]}" >"$work/$n.dir" 2>"$work/$n.err" &
done
wait
for n in "${names[@]}"; do
  cat "$work/$n.err" >>"$log"
  dirs[$n]="$(cat "$work/$n.dir")"
  [[ -n "${dirs[$n]}" ]]
  result "$n.rootfs" "$start" $?
done

for n in "${names[@]}"; do
  [[ -n "${dirs[$n]}" ]] || continue
  start=$SECONDS
  # shellcheck disable=SC2086
  in_root "${dirs[$n]}" "$n" "${reason[$n]}" "${python[$n]}" ${tests[$n]} >>"$log" 2>&1
  rc=$?
  # The image has no Abseil and (debian12, pypy3) no rdma-core: say so.
  if [[ "$n" != debian13 ]] && ls "${dirs[$n]}"/usr/lib/x86_64-linux-gnu/ |
      grep -qE '^lib(absl_|ibverbs|rdmacm)'; then
    echo "$n has Abseil or rdma-core installed" >>"$log"
    rc=1
  fi
  result "$n.ran" "$start" "$rc"
done

# The counts must reflect every case: a FAILED line anywhere fails the stage.
grep -q '^\[  FAILED  \]' "$log" && status=1
echo "wheel: full log in $log"
exit "$status"
