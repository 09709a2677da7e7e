#!/usr/bin/env bash
# Builds kvferry's wheel, self-contained: fetches Abseil's source
# (tools/fetch_abseil.sh) and runs ./bazelw build --config=wheel
# //python:wheel. Prints the wheel's path. The wheel installs on any x86-64
# Linux with glibc 2.34 or later (Debian 12, Ubuntu 22.04 and later, RHEL 9),
# into any CPython from 3.9 or PyPy; rdma-core and a CUDA driver are used
# when present.
#
#   tools/wheel.sh [bazel flags...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/fetch_abseil.sh >&2
./bazelw build --config=wheel //python:wheel "$@" >&2
ls "$PWD"/bazel-bin/python/kvferry-*-py3-none-manylinux_2_34_x86_64.whl | head -n1
