#!/usr/bin/env python3
"""Times the Mooncake surface's synchronous calls, for comparing two builds
of the kvferry package (e.g. the ctypes package against an older module)
side by side: run it once per PYTHONPATH, alternating, in one session.

Two processes on loopback TCP: the server registers an 8 MiB buffer, the
client writes into it with
  - transfer_sync_write of 4 KiB, one call per block (operations/s), and
  - batch_transfer_sync_write of 1,000 scattered 4 KiB blocks (every other
    4 KiB of the buffer, on both sides; batches/s).

    python3 sync_bench.py [--ops 3000] [--batches 60]

Prints one line per measurement, "name value unit".
"""
import argparse
import ctypes
import multiprocessing
import os
import time

os.environ.setdefault("KVFERRY_LOG_LEVEL", "warning")

from kvferry import TransferEngine  # noqa: E402

SIZE = 8 << 20
BLOCK = 4096


def serve(conn):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = (ctypes.c_char * SIZE)()
    assert e.register_memory(ctypes.addressof(buf), SIZE) == 0
    conn.send((e.get_local_address(), ctypes.addressof(buf)))
    conn.recv()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--batches", type=int, default=60)
    args = p.parse_args()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(child,))
    server.start()
    target, remote = parent.recv()
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = (ctypes.c_char * SIZE)()
    local = ctypes.addressof(buf)
    assert e.register_memory(local, SIZE) == 0
    assert e.transfer_sync_write(target, local, remote, BLOCK) == 0  # warm: handshake, links

    start = time.perf_counter()
    for i in range(args.ops):
        off = (i % (SIZE // BLOCK)) * BLOCK
        if e.transfer_sync_write(target, local + off, remote + off, BLOCK) != 0:
            raise SystemExit(e.get_last_error())
    took = time.perf_counter() - start
    print(f"transfer_sync_write_4KiB {args.ops / took:.0f} ops/s")

    n = 1000
    src = [local + 2 * i * BLOCK for i in range(n)]
    dst = [remote + 2 * i * BLOCK for i in range(n)]
    lengths = [BLOCK] * n
    assert e.batch_transfer_sync_write(target, src, dst, lengths) == 0
    start = time.perf_counter()
    for _ in range(args.batches):
        if e.batch_transfer_sync_write(target, src, dst, lengths) != 0:
            raise SystemExit(e.get_last_error())
    took = time.perf_counter() - start
    print(f"batch_transfer_sync_write_1000x4KiB {args.batches / took:.1f} batches/s")
    parent.send("done")
    server.join()


if __name__ == "__main__":
    main()
