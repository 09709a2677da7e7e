#!/usr/bin/env python3
"""Every method of Mooncake's Python TransferEngine, as serving code calls it.

Written against `mooncake.engine` only: it runs on kvferry once the stand-in
is installed (`python3 -m kvferry_compat install`), and on Mooncake itself.
Two processes on one host: the server allocates a managed buffer and waits
for a notification; the client moves bytes into it and back with every
transfer call, four threads writing layers at once, and every byte is
checked on both sides. Buffers are plain ctypes memory (no numpy needed).

    python3 every_method.py [--host 127.0.0.1|::1|[::1]] [--protocol tcp|rdma]

Prints "every method: OK" and exits 0 when all is well. The one
kvferry-specific line: KVFERRY_REMOTE_ACCESS=rw, because kvferry buffers
are writable by peers but not readable unless registered so (Mooncake lets
peers read every buffer), and this script reads its peer's buffer.
"""
import argparse
import ctypes
import json
import multiprocessing
import os
import sys
import threading
import time

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

os.environ.setdefault("KVFERRY_REMOTE_ACCESS", "rw")

SIZE = 1 << 20
LAYERS = 8  # four threads, two layers each
LAYER = SIZE // LAYERS


def pattern(n, salt):
    return bytes((i * 7 + salt + (i >> 8)) & 0xFF for i in range(n))


def check(ok, what):
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def server(args, conn):
    engine = TransferEngine()
    check(engine.initialize_ext(args.host, "P2PHANDSHAKE", args.protocol, "", "p2p") == 0,
          "server initialize_ext")
    buf = engine.allocate_managed_buffer(SIZE)
    check(buf != 0, "allocate_managed_buffer")
    engine.write_bytes_to_buffer(buf, bytes(SIZE), SIZE)
    port = engine.get_rpc_port()
    check(port > 0, "get_rpc_port")
    host = args.host.strip("[]")
    conn.send((f"{host}:{port}", buf))
    # The client says it is done with a notification after its last write.
    notes, deadline = [], time.time() + 60
    while not any(n.name == "client" for n in notes) and time.time() < deadline:
        notes += engine.get_notifies()
        time.sleep(0.01)
    final = engine.read_bytes_from_buffer(buf, SIZE)
    conn.send(([(n.name, n.msg) for n in notes], final == expected_final()))
    conn.recv()  # the client has read back
    check(engine.free_managed_buffer(buf, SIZE) == 0, "free_managed_buffer")


def expected_final():
    """What the server's buffer holds at the end: layer i from thread i % 4."""
    return b"".join(pattern(LAYER, 100 + i) for i in range(LAYERS))


def client(args, session, peer_buf):
    engine = TransferEngine()
    check(engine.initialize(args.host, "P2PHANDSHAKE", args.protocol, "") == 0,
          "client initialize")
    json.loads(engine.get_local_topology())  # {"cpu:0": [[near], [far]], ...}
    check(engine.get_engine().address != "", "get_engine")
    check(engine.get_engine_ptr() != 0, "get_engine_ptr")
    check(engine.send_probe(session) == 0, "send_probe")
    check(engine.warmup_efa_segment(session) == 0, "warmup_efa_segment")
    check(engine.get_first_buffer_address(session) == peer_buf, "get_first_buffer_address")

    src = (ctypes.c_char * SIZE)()
    back = (ctypes.c_char * SIZE)()
    extra = [(ctypes.c_char * 4096)() for _ in range(2)]
    a_src, a_back = ctypes.addressof(src), ctypes.addressof(back)
    check(engine.register_memory(a_src, SIZE, location="cpu:0") == 0, "register_memory")
    check(engine.register_memory(a_back, SIZE) == 0, "register_memory")
    extra_addrs = [ctypes.addressof(b) for b in extra]
    check(engine.batch_register_memory(extra_addrs, [4096, 4096]) == 0, "batch_register_memory")
    managed = engine.allocate_managed_buffer(64 << 10)
    check(managed != 0, "allocate_managed_buffer")

    data = pattern(SIZE, 1)
    check(engine.write_bytes_to_buffer(a_src, data, SIZE) == 0, "write_bytes_to_buffer")

    def read_back(n, what):
        check(engine.transfer_sync_read(session, a_back, peer_buf, n) == 0, what)
        got = engine.read_bytes_from_buffer(a_back, n)
        return got

    # Single and batched synchronous calls, with the hint Mooncake accepts.
    check(engine.transfer_sync_write(session, a_src, peer_buf, 4096, transport_hint="") == 0,
          "transfer_sync_write")
    check(read_back(4096, "transfer_sync_read") == data[:4096], "bytes of transfer_sync_write")
    offs = [8192, 20000, 65536]
    check(engine.batch_transfer_sync_write(session, [a_src + o for o in offs],
                                           [peer_buf + o for o in offs], [1000] * 3) == 0,
          "batch_transfer_sync_write")
    check(engine.batch_transfer_sync_read(session, [a_back + o for o in offs],
                                          [peer_buf + o for o in offs], [1000] * 3) == 0,
          "batch_transfer_sync_read")
    for o in offs:
        check(engine.read_bytes_from_buffer(a_back + o, 1000) == data[o:o + 1000],
              f"bytes at {o}")
    # Opcode-taking calls and a notification.
    check(engine.transfer_sync(session, a_src + 100000, peer_buf + 100000, 5000,
                               TransferOpcode.Write) == 0, "transfer_sync")
    check(engine.batch_transfer_sync(session, [a_back + 100000], [peer_buf + 100000], [5000],
                                     TransferOpcode.Read, notify=None) == 0,
          "batch_transfer_sync")
    check(engine.read_bytes_from_buffer(a_back + 100000, 5000) == data[100000:105000],
          "bytes of transfer_sync")
    # Asynchronous batches.
    b1 = engine.batch_transfer_async_write(session, [a_src + 200000], [peer_buf + 200000], [7000])
    b2 = engine.batch_transfer_async(session, [a_src + 300000], [peer_buf + 300000], [7000],
                                     TransferOpcode.Write)
    check(b1 != 0 and b2 != 0, "batch_transfer_async(_write)")
    check(engine.get_batch_transfer_status([b1, b2]) == 0, "get_batch_transfer_status")
    b3 = engine.batch_transfer_async_read(session, [a_back + 200000, a_back + 300000],
                                          [peer_buf + 200000, peer_buf + 300000], [7000, 7000])
    check(engine.get_batch_transfer_status([b3]) == 0, "batch_transfer_async_read")
    for o in (200000, 300000):
        check(engine.read_bytes_from_buffer(a_back + o, 7000) == data[o:o + 7000],
              f"async bytes at {o}")
    b4 = engine.transfer_submit_write(session, a_src + 400000, peer_buf + 400000, 9000)
    status, deadline = 0, time.time() + 30
    while status == 0 and time.time() < deadline:
        status = engine.transfer_check_status(b4)
    check(status == 1, f"transfer_check_status said {status}")
    check(read_back(SIZE, "read all")[400000:409000] == data[400000:409000],
          "bytes of transfer_submit_write")
    # A managed buffer as a source.
    engine.write_bytes_to_buffer(managed, b"\x5a" * 1024, 1024)
    check(engine.transfer_sync_write(session, managed, peer_buf + 500000, 1024) == 0,
          "write from a managed buffer")

    # Four threads, each writing its layers at once (as SGLang sends layers).
    layer_data = [pattern(LAYER, 100 + i) for i in range(LAYERS)]
    for i, d in enumerate(layer_data):
        engine.write_bytes_to_buffer(a_src + i * LAYER, d, LAYER)
    errors = []

    def send_layers(t):
        for i in range(t, LAYERS, 4):
            half = LAYER // 2
            r = engine.batch_transfer_sync_write(
                session, [a_src + i * LAYER, a_src + i * LAYER + half],
                [peer_buf + i * LAYER, peer_buf + i * LAYER + half], [half, half])
            if r != 0:
                errors.append(f"layer {i}: {engine.get_last_error()}")

    threads = [threading.Thread(target=send_layers, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, f"threads: {errors}")
    check(read_back(SIZE, "read all") == expected_final(), "bytes of the four threads")
    # Tell the server, with a notification after the last write.
    note = TransferNotify("client", "done")
    check(engine.transfer_sync(session, a_src, peer_buf, LAYER, TransferOpcode.Write,
                               notify=note) == 0, "transfer_sync with notify")

    check(engine.free_managed_buffer(managed, 64 << 10) == 0, "free_managed_buffer")
    check(engine.batch_unregister_memory(extra_addrs) == 0, "batch_unregister_memory")
    check(engine.unregister_memory(a_back) == 0, "unregister_memory")
    check(engine.unregister_memory(a_src) == 0, "unregister_memory")
    # Failures: a negative number and a reason, cleared by the next success.
    check(engine.transfer_sync_write(session, a_src, peer_buf, 64) < 0, "unregistered source")
    check(engine.get_last_error() != "", "get_last_error after a failure")
    check(engine.send_probe(session) == 0 and engine.get_last_error() == "",
          "get_last_error after a success")
    return engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--protocol", default="tcp")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server, args=(args, child))
    proc.start()
    session, peer_buf = parent.recv()
    client(args, session, peer_buf)
    notes, server_ok = parent.recv()
    parent.send("bye")
    proc.join(60)
    check(("client", "done") in notes, f"the server's notifies: {notes}")
    check(server_ok, "the server's buffer after the four threads")
    check(proc.exitcode == 0, f"server exit code {proc.exitcode}")
    print("every method: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
