#!/usr/bin/env python3
"""Builds kvferry's wheel from the module Bazel built (//python:wheel).

    make_wheel.py OUT.whl VERSION kvferry.so kvferry_compat.py

The wheel holds the extension module (kvferry.so), kvferry_compat.py (the
opt-in `mooncake.engine` stand-in) and the metadata pip needs. The module is
built against this machine's python3 and Debian's shared libraries, so the
wheel says `Requires-Python: ==X.Y.*` for the python3 that built it, and pip
refuses it elsewhere with that reason.
"""
import base64
import hashlib
import os
import sys
import zipfile

SUMMARY = "Zero-configuration KV-cache transfer engine (Mooncake-compatible Python API)"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(argv):
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    out, version, module, compat = argv[1:]
    dist = f"kvferry-{version}.dist-info"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = {}
    with open(module, "rb") as f:
        files["kvferry.so"] = f.read()
    with open(compat, "rb") as f:
        files["kvferry_compat.py"] = f.read()
    files[f"{dist}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: kvferry\nVersion: {version}\nSummary: {SUMMARY}\n"
        f"Requires-Python: =={python}.*\nLicense: Apache-2.0\n").encode()
    files[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: kvferry make_wheel.py\nRoot-Is-Purelib: false\n"
        "Tag: py3-none-linux_x86_64\n").encode()
    files[f"{dist}/top_level.txt"] = b"kvferry\nkvferry_compat\n"
    record = [record_line(name, data) for name, data in sorted(files.items())]
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))  # reproducible
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
