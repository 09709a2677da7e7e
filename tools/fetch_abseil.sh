#!/usr/bin/env bash
# Unpacks Debian's Abseil source (the version libabsl-dev has, with Debian's
# patches) into third_party/abseil/src, for the self-contained library
# (./bazelw build --config=wheel //c:libkvferry.so). Debian's static Abseil
# is not position-independent, so the library compiles Abseil itself.
#
# The source comes from the Debian archive the machine already uses, through
# a private apt configuration (deb-src lines of its own, lists in the cache
# directory): the system's apt setup is not changed. The unpacked tree is
# cached in ${KVFERRY_CACHE:-~/.cache/kvferry}; a second run takes no time.
# Usage: tools/fetch_abseil.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/third_party/abseil/src"
cache="${KVFERRY_CACHE:-$HOME/.cache/kvferry}/abseil"

version="$(dpkg-query -W -f='${source:Version}' libabsl-dev 2>/dev/null || true)"
[[ -n "$version" ]] || { echo "fetch_abseil: libabsl-dev is not installed (./bazelw installs it)" >&2; exit 1; }
tree="$cache/$version"

# Abseil's BUILD files load @bazel_skylib, which WORKSPACE maps to Debian's
# bazel-skylib (not one of bazelw's packages: only this build needs it).
if [[ ! -d /usr/share/bazel/tools/skylib ]]; then
  echo "fetch_abseil: installing bazel-skylib (Abseil's BUILD files load it)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bazel-skylib >&2
fi

if [[ ! -f "$tree/.complete" ]]; then
  command -v dpkg-source >/dev/null || {
    echo "fetch_abseil: installing dpkg-dev (dpkg-source)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends dpkg-dev >&2
  }
  work="$cache/work"
  rm -rf "$work" "$tree"
  mkdir -p "$work/lists/partial" "$work/etc"
  # deb-src lines for the suites the machine's own sources name.
  uris="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | head -1)"
  suite="$(. /etc/os-release && echo "$VERSION_CODENAME")"
  echo "deb-src ${uris:-http://deb.debian.org/debian} $suite main" >"$work/etc/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$work/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -q >&2
  (cd "$work" && apt-get "${apt_opts[@]}" source --download-only -q "abseil=$version" >&2)
  dpkg-source -x "$work"/abseil_*.dsc "$tree" >&2
  # Bazel 4's built-in @platforms has no wasm32/wasm64 constraints.
  sed -i -e '/":platforms_wasm32",/d' -e '/":platforms_wasm64",/d' "$tree/absl/BUILD.bazel"
  rm -rf "$work"
  touch "$tree/.complete"
fi

if [[ "$(readlink -f "$dest" 2>/dev/null)" != "$(readlink -f "$tree")" ]]; then
  rm -rf "$dest"
  mkdir -p "$(dirname "$dest")"
  ln -s "$tree" "$dest"
fi
echo "$dest -> $tree"
