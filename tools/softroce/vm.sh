#!/usr/bin/env bash
# Runs programs inside a QEMU VM that boots Debian's own kernel with the
# Soft-RoCE driver (rdma_rxe), for hosts whose kernel has no RDMA.
#
#   tools/softroce/vm.sh [--timeout=SECONDS] PROGRAM [PROGRAM...]
#
# Each PROGRAM (a host-built binary, e.g. a Bazel test) runs in one VM boot
# with rxe0 on the loopback netdev, in order; their output is printed as it
# comes. The exit status is 0 only if the VM reached its end marker (a
# per-run nonce) and every program exited 0: a kernel panic, a hang
# (timeout) or a missing marker is a failure.
#
# Needs (installed on demand with apt): qemu-system-x86, busybox-static,
# cpio, kmod, iproute2, libibverbs1, ibverbs-providers, ibverbs-utils,
# perftest. The kernel package is downloaded (never installed) once and
# cached with the base initramfs under ${KVFERRY_VM_CACHE:-~/.cache/kvferry/softroce}.
set -euo pipefail

timeout_s=600
programs=()
for a in "$@"; do
  case "$a" in
    --timeout=*) timeout_s="${a#--timeout=}" ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) programs+=("$a") ;;
  esac
done
((${#programs[@]})) || { echo "vm.sh: no program to run (see --help)" >&2; exit 2; }

packages=(qemu-system-x86 busybox-static cpio kmod iproute2 libibverbs1
          ibverbs-providers ibverbs-utils perftest)
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
  (cd "$work" && apt-get download "$abi" >/dev/null 2>&1) ||
    { echo "vm.sh: apt-get download $abi failed" >&2; exit 1; }
  dpkg -x "$work"/*.deb "$work/x"
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
/usr/bin/rdma link add rxe0 type rxe netdev lo
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
  (cd "$tree" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/base.cpio.gz"
  cp "$work/x/boot/vmlinuz-$kver" "$cache/vmlinuz"
  rm -rf "$work"
}

[[ -f "$cache/base.cpio.gz" && -f "$cache/vmlinuz" ]] || build_base

run="$(mktemp -d)"
trap 'rm -rf "$run"' EXIT
mkdir -p "$run/tree/t"
for p in "${programs[@]}"; do
  [[ -x "$p" ]] || { echo "vm.sh: $p is not an executable" >&2; exit 2; }
  name="$(basename "$p")"
  copy_with_libs "$run/tree" "$p" "/t/$name"
  echo "$name" >>"$run/tree/t/list"
done
(cd "$run/tree" && find . | cpio -o -H newc --quiet | gzip -1) >"$run/run.cpio.gz"
cat "$cache/base.cpio.gz" "$run/run.cpio.gz" >"$run/initrd"

nonce="$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
set +e
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 -nodefaults -no-user-config \
  -machine q35 -cpu qemu64 -m 2G -smp 2 -display none -serial stdio -monitor none \
  -no-reboot -kernel "$cache/vmlinuz" -initrd "$run/initrd" \
  -append "console=ttyS0 quiet panic=-1 kvf_nonce=$nonce" \
  -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
  -netdev hubport,id=n0,hubid=0 -device virtio-net-pci,netdev=n0,romfile= \
  </dev/null | tee "$run/console.log"
set -e
result="$(sed -n "s/^KVF-EXIT-$nonce=\([0-9]*\).*/\1/p" "$run/console.log" | tr -d '\r')"
if [[ -z "$result" ]]; then
  echo "vm.sh: the VM ended without its marker (panic, hang or timeout after ${timeout_s}s)" >&2
  exit 1
fi
exit "$result"
