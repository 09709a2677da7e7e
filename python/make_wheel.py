#!/usr/bin/env python3
"""Builds kvferry's wheel (//python:wheel).

    make_wheel.py OUT.whl VERSION libkvferry.so kvferry_compat.py kvferry/*.py

The wheel holds the pure-Python package kvferry (over the C API, ctypes),
libkvferry.so inside it, kvferry_compat.py (the opt-in `mooncake.engine`
stand-in) and the metadata pip needs. Nothing in it depends on the Python
version, so it is tagged py3-none: any CPython from 3.9 (Requires-Python)
and PyPy. The platform tag is manylinux_2_34_x86_64: built with
--config=wheel, libkvferry.so needs glibc 2.34 or later and nothing else
(tools/wheel_check.sh checks it with readelf).
"""
import base64
import hashlib
import os
import sys
import zipfile

SUMMARY = "Zero-configuration KV-cache transfer engine (Mooncake-compatible Python API)"
TAG = "py3-none-manylinux_2_34_x86_64"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(argv):
    if len(argv) < 6:
        print(__doc__, file=sys.stderr)
        return 2
    out, version, library, compat = argv[1:5]
    package = argv[5:]
    dist = f"kvferry-{version}.dist-info"
    files = {}
    with open(library, "rb") as f:
        files["kvferry/libkvferry.so"] = f.read()
    with open(compat, "rb") as f:
        files["kvferry_compat.py"] = f.read()
    for path in package:
        with open(path, "rb") as f:
            files["kvferry/" + os.path.basename(path)] = f.read()
    files[f"{dist}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: kvferry\nVersion: {version}\nSummary: {SUMMARY}\n"
        "Requires-Python: >=3.9\nLicense: Apache-2.0\n").encode()
    files[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: kvferry make_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {TAG}\n").encode()
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
