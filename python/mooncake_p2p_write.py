#!/usr/bin/env python3
"""A P2PHANDSHAKE write written against Mooncake's Python engine API.

The kvferry-specific lines are the import (with Mooncake installed,
`from mooncake.engine import TransferEngine` runs the same script) and
KVFERRY_REMOTE_ACCESS: kvferry buffers are writable by peers but not
readable unless registered so, and this script reads its peer's buffer.
Two processes: the server registers a buffer and hands its address over a
pipe; the client initializes, registers, writes with transfer_sync_write,
reads back with transfer_sync_read; the server checks the bytes.
"""
import multiprocessing
import os
import sys

import numpy as np

from kvferry import TransferEngine  # was: from mooncake.engine import TransferEngine

HOSTNAME = "127.0.0.1"
METADATA_SERVER = "P2PHANDSHAKE"
PROTOCOL = "tcp"
DEVICE_NAME = ""
SIZE = 1024 * 1024
# Peers may read this script's buffers too (set before the processes start).
os.environ.setdefault("KVFERRY_REMOTE_ACCESS", "rw")


def server(conn):
    engine = TransferEngine()
    if engine.initialize(HOSTNAME, METADATA_SERVER, PROTOCOL, DEVICE_NAME) != 0:
        raise RuntimeError("server initialize failed")
    session_id = f"{HOSTNAME}:{engine.get_rpc_port()}"
    buf = np.zeros(SIZE, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("server register_memory failed")
    conn.send((session_id, buf.ctypes.data))
    conn.recv()  # the client is done
    expected = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    conn.send(bool(np.array_equal(buf, expected)))
    engine.unregister_memory(buf.ctypes.data)


def client(conn):
    session_id, remote = conn.recv()
    engine = TransferEngine()
    if engine.initialize(HOSTNAME, METADATA_SERVER, PROTOCOL, DEVICE_NAME) != 0:
        raise RuntimeError("client initialize failed")
    data = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    back = np.zeros(SIZE, dtype=np.uint8)
    if engine.register_memory(data.ctypes.data, data.nbytes) != 0:
        raise RuntimeError("client register_memory failed")
    if engine.register_memory(back.ctypes.data, back.nbytes) != 0:
        raise RuntimeError("client register_memory failed")
    ret = engine.transfer_sync_write(session_id, data.ctypes.data, remote, SIZE)
    if ret != 0:
        raise RuntimeError(f"transfer_sync_write returned {ret}")
    ret = engine.transfer_sync_read(session_id, back.ctypes.data, remote, SIZE)
    if ret != 0:
        raise RuntimeError(f"transfer_sync_read returned {ret}")
    if not np.array_equal(back, data):
        raise RuntimeError("read back differs")
    conn.send("done")
    return conn.recv()


def main():
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=server, args=(a,))
    p.start()
    ok = client(b)
    p.join(30)
    if not ok or p.exitcode != 0:
        print("FAILED: the server did not receive the bytes")
        return 1
    print(f"verified: {SIZE} bytes written and read back over P2PHANDSHAKE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
