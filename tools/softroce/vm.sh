#!/usr/bin/env bash
# Runs programs inside a QEMU VM that boots Debian's own kernel with the
# Soft-RoCE driver (rdma_rxe), for hosts whose kernel has no RDMA.
#
#   tools/softroce/vm.sh [--timeout=SECONDS] [--pair] [--python] [--file=PATH]... PROGRAM [PROGRAM...]
#
# Each PROGRAM (a host-built binary or script, e.g. a Bazel test) runs in
# one VM boot with rxe0 on the loopback netdev, in order; their output is
# printed as it comes. The exit status is 0 only if the VM reached its end
# marker (a per-run nonce) and every program exited 0: a kernel panic, a
# hang (timeout) or a missing marker is a failure.
#
# --pair boots two VMs ("a" and "b") wired by a QEMU socket netdev; each has
# rxe0 on its virtio eth0 (10.0.10.1 and 10.0.10.2, MTU 9000) and runs the
# programs with KVFERRY_VM_ROLE=a|b, KVFERRY_VM_IP and KVFERRY_VM_PEER_IP set.
# Both must pass; VM a's console is printed, then VM b's.
# --file=PATH ships PATH to /t/ in the VM without running it (for scripts).
# --python adds Debian's python3 with its standard library (no packages),
# built once and cached beside the base initramfs.
# KVFERRY_VM_APPEND adds words to the kernel command line (programs read
# them from /proc/cmdline).
#
# Needs (installed on demand with apt): qemu-system-x86, busybox-static,
# cpio, kmod, iproute2, libibverbs1, ibverbs-providers, ibverbs-utils,
# perftest, ucx-utils. The kernel package is downloaded (never installed) once and
# cached with the base initramfs under ${KVFERRY_VM_CACHE:-~/.cache/kvferry/softroce}.
set -euo pipefail

timeout_s=600
pair=0
python=0
programs=()
files=()
for a in "$@"; do
  case "$a" in
    --timeout=*) timeout_s="${a#--timeout=}" ;;
    --pair) pair=1 ;;
    --file=*) files+=("${a#--file=}") ;;
    --python) python=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    -*) echo "vm.sh: unknown option $a (see --help)" >&2; exit 2 ;;
    *) programs+=("$a") ;;
  esac
done
((${#programs[@]})) || { echo "vm.sh: no program to run (see --help)" >&2; exit 2; }

packages=(qemu-system-x86 busybox-static cpio kmod iproute2 libibverbs1
          ibverbs-providers ibverbs-utils perftest ucx-utils)
((python)) && packages+=(python3)
missing=()
installed="$( (dpkg-query -W -f='${db:Status-Status} ${Package}\n' "${packages[@]}" \
  2>/dev/null || true) | awk '$1 == "installed" {print $2}')"
for p in "${packages[@]}"; do grep -qx -- "$p" <<<"$installed" || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "vm.sh: installing ${missing[*]}" >&2
  apt-cache show "${missing[0]}" >/dev/null 2>&1 || apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >&2
fi

abi="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')"
[[ -n "$abi" ]] || { echo "vm.sh: cannot find Debian's kernel package" >&2; exit 1; }
kver="${abi#linux-image-}"
cache="${KVFERRY_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvferry/softroce}/$kver"
arch_libs=/usr/lib/x86_64-linux-gnu

# Copies a binary and every library ldd finds for it into the tree $1.
copy_with_libs() {
  local tree="$1" bin="$2" dest="$3"
  mkdir -p "$tree$(dirname "$dest")"
  cp -L "$bin" "$tree$dest"
  (ldd "$bin" 2>/dev/null || true) | awk '/=> \// {print $3} /^\s*\/lib/ {print $1}' | while read -r lib; do
    mkdir -p "$tree/kvf/lib"
    [[ -e "$tree/kvf/lib/$(basename "$lib")" ]] || cp -L "$lib" "$tree/kvf/lib/"
  done
}

build_base() {
  local work; work="$(mktemp -d)"
  echo "vm.sh: preparing kernel $kver and the base initramfs (once)" >&2
  mkdir -p "$cache"
  if [[ ! -f "$cache/kernel.deb" ]]; then
    (cd "$work" && apt-get download "$abi" >/dev/null 2>&1) ||
      { echo "vm.sh: apt-get download $abi failed" >&2; exit 1; }
    mv "$work"/*.deb "$cache/kernel.deb"
  fi
  dpkg -x "$cache/kernel.deb" "$work/x"
  depmod -b "$work/x" "$kver"
  local tree="$work/tree"
  mkdir -p "$tree"/{bin,sbin,proc,sys,dev,tmp,etc/libibverbs.d,kvf/lib,kvf/modules,t} "$cache"
  cp /bin/busybox "$tree/bin/busybox"
  # Modules in dependency order, each once.
  local order="$tree/kvf/modules.order"
  : >"$order"
  for m in rdma_rxe crc32_generic virtio_pci virtio_net dummy rdma_ucm; do
    modprobe -d "$work/x" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
  done | awk '!seen[$0]++' | while read -r ko; do
    cp "$ko" "$tree/kvf/modules/"
    basename "$ko" >>"$order"
  done
  for b in /usr/bin/ip /usr/bin/rdma /usr/bin/ibv_devinfo /usr/bin/ib_write_bw /usr/bin/ib_write_lat; do
    [[ -x "$b" ]] && copy_with_libs "$tree" "$b" "$b"
  done
  # UCX's perftest (a peer reference for benchmarks); it dlopens its
  # transports from "ucx/" beside libucs, here /kvf/lib/ucx.
  if [[ -x /usr/bin/ucx_perftest ]]; then
    copy_with_libs "$tree" /usr/bin/ucx_perftest /usr/bin/ucx_perftest
    mkdir -p "$tree/kvf/lib/ucx"
    for m in "$arch_libs"/ucx/libuct_*.so.0; do
      copy_with_libs "$tree" "$m" "/kvf/lib/ucx/$(basename "$m")"
    done
  fi
  cp -L "$arch_libs"/libibverbs/librxe-rdmav*.so "$tree/kvf/lib/"
  mkdir -p "$tree$arch_libs/libibverbs"
  cp -L "$arch_libs"/libibverbs/librxe-rdmav*.so "$tree$arch_libs/libibverbs/"
  cp /etc/libibverbs.d/rxe.driver "$tree/etc/libibverbs.d/"
  cp -L "$arch_libs/libgcc_s.so.1" "$tree/kvf/lib/"
  mkdir -p "$tree/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$tree/lib64/"
  cat >"$tree/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin LD_LIBRARY_PATH=/kvf/lib KVFERRY_REQUIRE_RDMA=1
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $(cat /kvf/modules.order); do insmod /kvf/modules/$m >/dev/null 2>&1; done
/usr/bin/ip link set lo up
arg() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
role=$(arg kvf_role)
if [ -n "$role" ]; then
  # One of a pair: rxe on the virtio NIC that joins the two VMs.
  export KVFERRY_VM_ROLE=$role KVFERRY_VM_IP=$(arg kvf_ip) KVFERRY_VM_PEER_IP=$(arg kvf_peer)
  /usr/bin/ip link set eth0 mtu 9000 up
  /usr/bin/ip addr add $KVFERRY_VM_IP/24 dev eth0
  /usr/bin/rdma link add rxe0 type rxe netdev eth0
  echo "vm: $role at $KVFERRY_VM_IP, peer $KVFERRY_VM_PEER_IP"
else
  /usr/bin/rdma link add rxe0 type rxe netdev lo
fi
i=0
while [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" != "4: ACTIVE" ]; do
  i=$((i + 1)); [ $i -gt 100 ] && break; sleep 0.1
done
echo "vm: rxe0 $(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)"
nonce=$(sed -n 's/.*kvf_nonce=\([0-9a-f]*\).*/\1/p' /proc/cmdline)
rc=0
for t in $(cat /t/list); do
  echo "=== vm: running $t"
  (cd /tmp && TEST_TMPDIR=/tmp /t/$t); r=$?
  echo "=== vm: $t exited $r"
  [ $r -eq 0 ] || rc=1
done
echo "KVF-EXIT-$nonce=$rc"
sleep 0.3
printf '\000' | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
poweroff -f
INIT
  chmod +x "$tree/init"
  (cd "$tree" && find . | cpio -o -H newc --quiet | gzip -1) >"$base"
  cp "$work/x/boot/vmlinuz-$kver" "$cache/vmlinuz"
  rm -rf "$work"
}

# Debian's python3 and its standard library (tests, GUI and packaging
# tools left out), the libraries its binary and C modules need in /kvf/lib.
build_python() {
  local work; work="$(mktemp -d)"
  echo "vm.sh: preparing python3 for the VM (once)" >&2
  local tree="$work/tree" stdlib
  stdlib="$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
  copy_with_libs "$tree" "$(readlink -f /usr/bin/python3)" /usr/bin/python3
  mkdir -p "$tree$stdlib"
  tar -C "$stdlib" -cf - --exclude=./test --exclude=./idlelib --exclude=./tkinter \
    --exclude=./turtledemo --exclude=./ensurepip --exclude=./lib2to3 --exclude=./pydoc_data \
    --exclude='./config-*' --exclude=./site-packages --exclude=./dist-packages . |
    tar -C "$tree$stdlib" -xf -
  for m in "$stdlib"/lib-dynload/*.so; do copy_with_libs "$tree" "$m" "$m"; done
  (cd "$tree" && find . | cpio -o -H newc --quiet | gzip -1) >"$python_layer.tmp"
  mv "$python_layer.tmp" "$python_layer"
  rm -rf "$work"
}

# The base initramfs (and the python layer) is rebuilt whenever this
# script changes.
hash="$(sha256sum "$0" | cut -c1-12)"
base="$cache/base-$hash.cpio.gz"
[[ -f "$base" && -f "$cache/vmlinuz" ]] || { rm -f "$cache"/base*.cpio.gz; build_base; }
python_layer="$cache/python-$hash.cpio.gz"
if ((python)) && [[ ! -f "$python_layer" ]]; then
  rm -f "$cache"/python-*.cpio.gz
  build_python
fi

run="$(mktemp -d)"
trap 'rm -rf "$run"; [[ -n "${pid_a:-}" ]] && kill "$pid_a" 2>/dev/null; true' EXIT
mkdir -p "$run/tree/t"
for p in "${programs[@]}" "${files[@]}"; do
  [[ -f "$p" ]] || { echo "vm.sh: $p does not exist" >&2; exit 2; }
  copy_with_libs "$run/tree" "$p" "/t/$(basename "$p")"
done
for p in "${programs[@]}"; do
  [[ -x "$p" ]] || { echo "vm.sh: $p is not an executable" >&2; exit 2; }
  basename "$p" >>"$run/tree/t/list"
done
(cd "$run/tree" && find . | cpio -o -H newc --quiet | gzip -1) >"$run/run.cpio.gz"
layers=("$base")
((python)) && layers+=("$python_layer")
cat "${layers[@]}" "$run/run.cpio.gz" >"$run/initrd"

# boot NAME CPUS NETDEV MAC APPEND: starts one VM in the background; its
# console goes to $run/NAME.log. Sets $nonce_NAME. tsc=reliable: TCG's TSC
# looks unsynchronized, and the HPET fallback makes every clock read a
# trapped syscall (tens of microseconds), which would distort every timing.
boot() {
  local name="$1" cpus="$2" netdev="$3" mac="$4" append="$5"
  local nonce; nonce="$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
  printf -v "nonce_$name" %s "$nonce"
  # The console log exists before `tail -f` looks for it (a tail that found
  # no file yet printed nothing, and the run looked silent but passed).
  : >"$run/$name.log"
  timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 -nodefaults -no-user-config \
    -machine q35 -cpu qemu64 -m 2G -smp "$cpus" -display none -serial stdio -monitor none \
    -no-reboot -kernel "$cache/vmlinuz" -initrd "$run/initrd" \
    -append "console=ttyS0 quiet panic=-1 tsc=reliable clocksource=tsc kvf_nonce=$nonce $append ${KVFERRY_VM_APPEND:-}" \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
    -netdev "$netdev" -device "virtio-net-pci,netdev=n0,mac=$mac,romfile=" \
    </dev/null >>"$run/$name.log" 2>&1 &
}

# result NAME: the VM's exit status from its marker, or 1 without it.
result() {
  local name="$1" nonce_var="nonce_$1"
  local r; r="$(sed -n "s/^KVF-EXIT-${!nonce_var}=\([0-9]*\).*/\1/p" "$run/$name.log" | tr -d '\r')"
  if [[ -z "$r" ]]; then
    echo "vm.sh: VM $name ended without its marker (panic, hang or timeout after ${timeout_s}s)" >&2
    return 1
  fi
  return "$r"
}

set +e
if ((pair)); then
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  # Distinct MACs: rxe treats a frame to its own MAC as loopback, so with
  # QEMU's default MAC on both VMs nothing would ever cross the wire.
  boot a 1 "socket,id=n0,listen=127.0.0.1:$port" 52:54:00:00:10:01 "kvf_role=a kvf_ip=10.0.10.1 kvf_peer=10.0.10.2"
  pid_a=$!
  for _ in $(seq 100); do  # the listener must be up before b connects
    ss -ltn "sport = :$port" 2>/dev/null | grep -q LISTEN && break
    sleep 0.1
  done
  boot b 1 "socket,id=n0,connect=127.0.0.1:$port" 52:54:00:00:10:02 "kvf_role=b kvf_ip=10.0.10.2 kvf_peer=10.0.10.1"
  pid_b=$!
  wait "$pid_b"; wait "$pid_a"; pid_a=
  for name in a b; do
    echo "=== vm.sh: console of VM $name"
    cat "$run/$name.log"
  done
  result a; ra=$?
  result b; rb=$?
  ((ra == 0 && rb == 0)) && exit 0
  exit 1
fi
boot vm 2 "hubport,id=n0,hubid=0" 52:54:00:12:34:56 ""
pid=$!
tail -f --pid="$pid" "$run/vm.log" 2>/dev/null &
tail_pid=$!
wait "$pid"
wait "$tail_pid"
result vm
