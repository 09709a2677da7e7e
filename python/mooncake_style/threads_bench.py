#!/usr/bin/env python3
"""Layers sent from 1 thread and from 4 threads at once, through Mooncake's
API (SGLang sends each layer of a request from its own thread).

The same bytes either way: LAYERS layers of --layer_kib KiB each, per
round, over one engine pair (the same connections), batch_transfer_sync_write
per layer, split into --pages page-sized requests. Prints the p50 and p99 of
a round for each, and their ratio. A benchmark, not a test: nothing here
asserts a time.

    python3 threads_bench.py [--rounds 200] [--layer_kib 256] [--pages 64]
"""
import argparse
import ctypes
import multiprocessing
import os
import statistics
import sys
import threading
import time

from mooncake.engine import TransferEngine

LAYERS = 8


def server(conn, size):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = e.allocate_managed_buffer(size)
    conn.send((f"127.0.0.1:{e.get_rpc_port()}", buf))
    conn.recv()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--layer_kib", type=int, default=256)
    p.add_argument("--pages", type=int, default=64)
    args = p.parse_args()
    layer = args.layer_kib << 10
    size = LAYERS * layer
    page = layer // args.pages
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server, args=(child, size))
    proc.start()
    session, peer = parent.recv()
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = (ctypes.c_char * size)()
    a = ctypes.addressof(src)
    assert e.register_memory(a, size) == 0

    def send(layers):
        for i in layers:
            base = i * layer
            offs = [base + k * page for k in range(args.pages)]
            assert e.batch_transfer_sync_write(session, [a + o for o in offs],
                                               [peer + o for o in offs],
                                               [page] * args.pages) == 0, e.get_last_error()

    def one_thread():
        send(range(LAYERS))

    def four_threads():
        ts = [threading.Thread(target=send, args=(range(t, LAYERS, 4),)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    results = {}
    for name, fn in (("1 thread", one_thread), ("4 threads", four_threads)):
        fn()  # warm-up
    times = {"1 thread": [], "4 threads": []}
    for _ in range(args.rounds):  # alternating, so both see the same machine
        for name, fn in (("1 thread", one_thread), ("4 threads", four_threads)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        t.sort()
        results[name] = (statistics.median(t), t[int(len(t) * 0.99) - 1])
        print(f"{name:9}: round of {size >> 10} KiB in {args.pages}-request layers: "
              f"p50 {results[name][0] * 1e3:.2f} ms, p99 {results[name][1] * 1e3:.2f} ms")
    one, four = results["1 thread"], results["4 threads"]
    print(f"4 threads / 1 thread: p50 {four[0] / one[0]:.2f}x, p99 {four[1] / one[1]:.2f}x")
    parent.send("bye")
    proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
