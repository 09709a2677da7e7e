"""The kvferry Python module: the Mooncake-compatible engine, the Pythonic
engine and KV layer, errors as exceptions, the GIL released, metrics."""
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import kvferry  # noqa: E402


def _target(conn, size):
    """A second process: an engine serving a numpy buffer."""
    engine = kvferry.Engine(host="127.0.0.1", transport="tcp")
    buf = np.zeros(size, dtype=np.uint8)
    engine.register_memory(buf.ctypes.data, buf.nbytes, access="rw")  # written, then read
    conn.send((engine.address, buf.ctypes.data))
    conn.recv()
    conn.send(bytes(buf[:16]) + bytes(buf[-16:]))
    conn.recv()


class _TargetProcess:
    """_target in a second process, as a context: gives (its engine's address,
    its buffer's address); edges() asks for its buffer's first and last 16
    bytes; on exit it is told to go and must exit 0."""

    def __init__(self, test, size):
        self._test, self._size, self._edges_asked = test, size, False

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self._mine, theirs = ctx.Pipe()
        self._p = ctx.Process(target=_target, args=(theirs, self._size))
        self._p.start()
        return self._mine.recv()

    def edges(self):
        self._edges_asked = True
        self._mine.send("show me")
        return self._mine.recv()

    def __exit__(self, *exc):
        if not self._edges_asked:
            self.edges()
        self._mine.send("bye")
        self._p.join(30)
        self._test.assertEqual(self._p.exitcode, 0)
        return False


class MooncakeCompatTest(unittest.TestCase):
    def test_a_mooncake_script_runs_unchanged(self):
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, os.path.join(HERE, "mooncake_p2p_write.py")],
                             env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("verified", out.stdout)

    def test_return_conventions_and_last_error(self):
        engine = kvferry.TransferEngine()
        self.assertEqual(engine.register_memory(1 << 20, 4096), -1)  # not initialized
        self.assertIn("initialize", engine.get_last_error())
        self.assertEqual(engine.initialize("127.0.0.1", "etcd://10.0.0.1:2379", "tcp", ""), -1)
        self.assertIn("P2PHANDSHAKE", engine.get_last_error())
        self.assertEqual(engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        self.assertGreater(engine.get_rpc_port(), 0)
        buf = np.zeros(4096, dtype=np.uint8)
        self.assertEqual(engine.register_memory(buf.ctypes.data, buf.nbytes), 0)
        self.assertEqual(engine.register_memory(buf.ctypes.data, buf.nbytes), -1)  # overlap
        self.assertIn("overlaps", engine.get_last_error())
        ret = engine.transfer_sync_write("127.0.0.1:1", buf.ctypes.data, 0, 64)
        self.assertLess(ret, 0)
        self.assertEqual(engine.unregister_memory(buf.ctypes.data), 0)
        a = np.zeros(4096, dtype=np.uint8)
        b = np.zeros(4096, dtype=np.uint8)
        self.assertEqual(engine.batch_register_memory([a.ctypes.data, b.ctypes.data],
                                                      [4096, 4096]), 0)
        self.assertEqual(engine.batch_unregister_memory([a.ctypes.data, b.ctypes.data]), 0)


class EngineTest(unittest.TestCase):
    def test_two_processes_move_numpy_buffers(self):
        size = 8 << 20
        target = _TargetProcess(self, size)
        with target as (peer, remote):
            engine = kvferry.Engine(host="127.0.0.1", transport="tcp")
            src = (np.arange(size, dtype=np.uint64) * 7).astype(np.uint8)
            back = np.zeros(size, dtype=np.uint8)
            engine.register_memory(src.ctypes.data, src.nbytes)
            engine.register_memory(back.ctypes.data, back.nbytes)
            half = size // 2
            engine.transfer(peer, [("write", src.ctypes.data, remote, half),
                                   ("write", src.ctypes.data + half, remote + half, half)])
            engine.transfer(peer, [("read", back.ctypes.data, remote, size)])
            np.testing.assert_array_equal(back, src)
            self.assertEqual(target.edges(), bytes(src[:16]) + bytes(src[-16:]))
            # Errors are exceptions carrying the engine's message and code.
            with self.assertRaises(kvferry.Error) as err:
                engine.transfer(peer, [("write", src.ctypes.data, 64, 128)])
            self.assertIn("no registered region", str(err.exception))
            self.assertEqual(err.exception.code, "INVALID_ARGUMENT")
            with self.assertRaises(kvferry.Error):
                engine.transfer(peer, [("copy", src.ctypes.data, remote, 1)])
            with self.assertRaises(kvferry.Error) as gone:
                engine.transfer("127.0.0.1:1", [("write", src.ctypes.data, remote, 1)])
            self.assertEqual(gone.exception.code, "UNAVAILABLE")

    def test_a_transfer_that_times_out_has_ended_when_it_raises(self):
        # 64 MiB read back over loopback with a 1 ms timeout: the call raises
        # DEADLINE_EXCEEDED, and by then every byte it was to read is in
        # place; none lands in the buffer afterwards (it used to keep
        # landing after the raise, into a buffer the caller may have freed).
        size = 64 << 20
        with _TargetProcess(self, size) as (peer, remote):
            engine = kvferry.Engine(host="127.0.0.1", transport="tcp")
            src = (np.arange(size, dtype=np.uint64) * 13 + 1).astype(np.uint8)
            back = np.zeros(size, dtype=np.uint8)
            engine.register_memory(src.ctypes.data, size, access="none")
            engine.register_memory(back.ctypes.data, size)
            engine.transfer(peer, [("write", src.ctypes.data, remote, size)])
            with self.assertRaises(kvferry.Error) as err:
                engine.transfer(peer, [("read", back.ctypes.data, remote, size)], timeout=0.001)
            self.assertEqual(err.exception.code, "DEADLINE_EXCEEDED")
            self.assertIn("nothing of it lands after this", str(err.exception))
            self.assertTrue(np.array_equal(back, src), "the read was still landing")
            # The Mooncake surface (kvferry_transfer_sync in the C API) too.
            te = kvferry.TransferEngine()
            self.assertEqual(te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
            again = np.zeros(size, dtype=np.uint8)
            self.assertEqual(te.register_memory(again.ctypes.data, size), 0)
            te._timeout = 0.001 - size / 1e9  # 1 ms for these 64 MiB
            self.assertEqual(te.transfer_sync_read(peer, again.ctypes.data, remote, size), -1)
            self.assertIn("DEADLINE_EXCEEDED", te.get_last_error())
            self.assertIn("nothing of it lands after this", te.get_last_error())
            self.assertTrue(np.array_equal(again, src), "the read was still landing")

    def test_the_gil_is_released_during_transfers(self):
        a = kvferry.Engine(host="127.0.0.1", transport="tcp")
        b = kvferry.Engine(host="127.0.0.1", transport="tcp")
        size = 128 << 20
        src = np.ones(size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        a.register_memory(src.ctypes.data, size)
        b.register_memory(dst.ctypes.data, size)
        running = threading.Event()
        stop = threading.Event()
        ticks = [0]

        def spin():
            while not stop.is_set():
                if running.is_set():
                    ticks[0] += 1

        t = threading.Thread(target=spin)
        t.start()
        running.set()
        start = time.monotonic()
        a.transfer(b.address, [("write", src.ctypes.data, dst.ctypes.data, size)] * 4)
        took = time.monotonic() - start
        running.clear()
        stop.set()
        t.join()
        # Holding the GIL for the whole call would leave the other thread a
        # switch or two at most.
        self.assertGreater(ticks[0], 100, f"{ticks[0]} ticks in {took:.3f} s")
        self.assertEqual(int(dst[-1]), 1)

    def test_ports_and_durations_out_of_range_are_refused(self):
        for port in (70000, -1, 65536):
            with self.assertRaises(kvferry.Error) as err:
                kvferry.Engine(host="127.0.0.1", transport="tcp", port=port)
            self.assertEqual(err.exception.code, "INVALID_ARGUMENT")
        engine = kvferry.Engine(host="127.0.0.1", transport="tcp")
        pool = kvferry.KvPool(1, True, 1, 64, 1, [np.zeros(64, dtype=np.uint8).ctypes.data])
        for bad in (float("nan"), float("inf"), -1.0, 0.0, "soon"):
            with self.assertRaises(kvferry.Error) as err:
                kvferry.KvReceiver(engine, pool, peer_timeout=bad)
            self.assertEqual(err.exception.code, "INVALID_ARGUMENT")
        with self.assertRaises(kvferry.Error):
            engine.transfer(engine.address, [], timeout=float("nan"))

    def test_an_ipv6_host_in_brackets_is_accepted(self):
        engine = kvferry.Engine(host="[::1]", transport="tcp")
        self.assertTrue(engine.address.startswith("[::1]:"), engine.address)
        with self.assertRaises(kvferry.Error) as bad:
            kvferry.Engine(host="[::1", transport="tcp")
        self.assertIn("needs its ']'", str(bad.exception))

    def test_buffers_are_writable_not_readable_unless_registered_so(self):
        a = kvferry.Engine(host="127.0.0.1", transport="tcp")
        b = kvferry.Engine(host="127.0.0.1", transport="tcp")
        mine = np.arange(4096, dtype=np.uint8)
        secret = np.full(4096, 42, dtype=np.uint8)
        readable = np.full(4096, 7, dtype=np.uint8)
        a.register_memory(mine.ctypes.data, mine.nbytes)
        b.register_memory(secret.ctypes.data, secret.nbytes)  # default: "w"
        b.register_memory(readable.ctypes.data, readable.nbytes, access="r")
        with self.assertRaises(kvferry.Error) as e:
            a.transfer(b.address, [("read", mine.ctypes.data, secret.ctypes.data, 4096)])
        self.assertIn("does not allow remote read", str(e.exception))
        self.assertIn("KVFERRY_REMOTE_ACCESS=rw", str(e.exception))  # what allows it
        self.assertEqual(int(mine[5]), 5)  # nothing was read
        a.transfer(b.address, [("write", mine.ctypes.data, secret.ctypes.data, 4096)])
        self.assertEqual(int(secret[5]), 5)
        a.transfer(b.address, [("read", mine.ctypes.data, readable.ctypes.data, 4096)])
        self.assertEqual(int(mine[5]), 7)
        with self.assertRaises(kvferry.Error):
            b.register_memory(mine.ctypes.data, 16, access="x")

    def test_mooncake_surface_defaults_to_write_only(self):
        engine = kvferry.TransferEngine()
        self.assertEqual(engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        buf = np.zeros(4096, dtype=np.uint8)
        self.assertEqual(engine.register_memory(buf.ctypes.data, 1024), 0)
        self.assertEqual(engine.register_memory(buf.ctypes.data + 1024, 1024, access="rw"), 0)
        self.assertEqual(engine.register_memory(buf.ctypes.data + 2048, 1024, access="bad"), -1)
        self.assertIn("access 'bad'", engine.get_last_error())


class KvTest(unittest.TestCase):
    def test_pages_move_between_pools_of_numpy_arrays(self):
        layers, page_tokens, bytes_per_token, pages = 2, 16, 256, 32
        page = page_tokens * bytes_per_token
        prefill = kvferry.Engine(host="127.0.0.1", transport="tcp")
        decode = kvferry.Engine(host="127.0.0.1", transport="tcp")
        src = [np.full(page * pages, i + 1, dtype=np.uint8) for i in range(layers * 2)]
        for arr in src:
            arr[::page] = np.arange(pages, dtype=np.uint8)  # page numbers
        dst = [np.zeros(page * pages, dtype=np.uint8) for _ in range(layers * 2)]
        src_pool = kvferry.KvPool(layers, False, page_tokens, bytes_per_token, pages,
                                  [a.ctypes.data for a in src])
        dst_pool = kvferry.KvPool(layers, False, page_tokens, bytes_per_token, pages,
                                  [a.ctypes.data for a in dst])
        receiver = kvferry.KvReceiver(decode, dst_pool)
        sender = kvferry.KvSender(prefill, src_pool)
        sender.send("req-1", decode.address, [0, 1, 5], [10, 11, 20], aux="first token 7")
        self.assertEqual(receiver.wait("req-1", timeout=10), b"first token 7")
        for s, d in zip(src, dst):
            for sp, dp in ((0, 10), (1, 11), (5, 20)):
                np.testing.assert_array_equal(d[dp * page:(dp + 1) * page],
                                              s[sp * page:(sp + 1) * page])
        with self.assertRaises(kvferry.Error) as err:
            sender.send("req-2", decode.address, [0], [pages + 3])
        self.assertIn("outside", str(err.exception))
        with self.assertRaises(kvferry.Error):
            kvferry.KvPool(0, False, 16, 256, 32, [])


    def _pools(self, pages=8):
        layers, page_tokens, bytes_per_token = 2, 16, 256
        size = page_tokens * bytes_per_token * pages
        src = [np.full(size, i + 1, dtype=np.uint8) for i in range(layers * 2)]
        dst = [np.zeros(size, dtype=np.uint8) for _ in range(layers * 2)]
        make = lambda arrs: kvferry.KvPool(layers, False, page_tokens, bytes_per_token, pages,
                                           [a.ctypes.data for a in arrs])
        return src, dst, make(src), make(dst)

    def test_the_application_drains_its_notifications_and_the_receiver_its_words(self):
        prefill = kvferry.Engine(host="127.0.0.1", transport="tcp")
        decode = kvferry.Engine(host="127.0.0.1", transport="tcp")
        src, dst, src_pool, dst_pool = self._pools()
        receiver = kvferry.KvReceiver(decode, dst_pool)
        sender = kvferry.KvSender(prefill, src_pool)
        prefill.notify(decode.address, "before")
        sender.send("r", decode.address, [0], [1], aux="aux")
        prefill.notify(decode.address, b"after")
        got = decode.notifications(timeout=5)
        self.assertEqual([m for _, m in got], [b"before", b"after"])
        self.assertEqual({s for s, _ in got}, {prefill.engine_id})
        self.assertEqual(decode.notifications(), [])
        self.assertEqual(receiver.wait("r", timeout=5), b"aux")

    def test_layer_wise_send_and_cancel_reach_the_decode(self):
        prefill = kvferry.Engine(host="127.0.0.1", transport="tcp")
        decode = kvferry.Engine(host="127.0.0.1", transport="tcp")
        src, dst, src_pool, dst_pool = self._pools()
        receiver = kvferry.KvReceiver(decode, dst_pool, peer_timeout=2.0)
        sender = kvferry.KvSender(prefill, src_pool)
        receiver.expect("layered", prefill.address)
        h = sender.begin("layered", decode.address, [0, 1], [2, 3])
        sender.send_layer(h, 0)
        self.assertIsNone(receiver.poll("layered"))
        sender.send_layer(h, 1)
        sender.finish(h, aux="tok")
        self.assertEqual(receiver.wait("layered", timeout=10), b"tok")
        self.assertEqual(receiver.poll("layered"), b"tok")
        np.testing.assert_array_equal(dst[3][2 * 4096:4 * 4096], src[3][:2 * 4096])
        with self.assertRaises(kvferry.Error):
            sender.send_layer(h, 0)  # the handle is gone after finish

        h = sender.begin("dropped", decode.address, [4], [5])
        sender.send_layer(h, 0)
        sender.cancel(h, reason="client went away")
        with self.assertRaises(kvferry.Error) as err:
            receiver.wait("dropped", timeout=10)
        self.assertIn("client went away", str(err.exception))
        with self.assertRaises(kvferry.Error) as err:
            receiver.poll("dropped")
        receiver.forget("dropped")
        self.assertIsNone(receiver.poll("dropped"))

    def test_a_prefill_that_never_answers_fails_the_expected_request(self):
        decode = kvferry.Engine(host="127.0.0.1", transport="tcp")
        gone = _engine_on_a_port_no_one_else_takes()
        address = gone.address
        del gone  # the engine stops listening
        _, _, _, dst_pool = self._pools()
        receiver = kvferry.KvReceiver(decode, dst_pool, peer_timeout=1.0)
        receiver.expect("orphan", address)
        start = time.monotonic()
        with self.assertRaises(kvferry.Error) as err:
            receiver.wait("orphan", timeout=10)
        took = time.monotonic() - start
        # Nothing listens at its port: gone for certain, reported at the
        # first probe.
        self.assertIn("refuses connections", str(err.exception))
        self.assertLess(took, 0.5)
        with self.assertRaises(kvferry.Error):
            receiver.expect("x", "not an address")


def _engine_on_a_port_no_one_else_takes():
    """An engine on a port below the kernel's ephemeral range and away from
    the engines' default ports (15981 up): once it is gone, no engine of a
    test run in parallel starts listening there in its place."""
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.time_ns())
    error = None
    for _ in range(20):
        port = rng.randrange(max(20000, lo - 12000), max(20001, lo))
        try:
            return kvferry.Engine(host="127.0.0.1", port=port, transport="tcp")
        except kvferry.Error as e:  # taken: another
            error = e
    raise error


class MetricsTest(unittest.TestCase):
    def test_prometheus_endpoint_counts_traffic(self):
        a = kvferry.Engine(host="127.0.0.1", transport="tcp", metrics_port=0)
        b = kvferry.Engine(host="127.0.0.1", transport="tcp")
        src = np.ones(1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        a.register_memory(src.ctypes.data, src.nbytes)
        b.register_memory(dst.ctypes.data, dst.nbytes)

        def scrape():
            with urllib.request.urlopen(f"http://{a.metrics_address}/metrics", timeout=10) as r:
                return r.read().decode()

        series = f'kvferry_bytes_total{{engine="{a.address}",peer="{b.address}",op="write"}}'
        for n in (1, 2):
            a.transfer(b.address, [("write", src.ctypes.data, dst.ctypes.data, src.nbytes)])
            text = scrape()
            line = [l for l in text.splitlines() if l.startswith(series + " ")]
            self.assertEqual(len(line), 1, text)
            self.assertEqual(float(line[0].split()[-1]), n * src.nbytes)
        m = a.metrics()
        self.assertEqual(m["peers"][0]["requests_ok"], 2)
        self.assertGreater(m["peers"][0]["latency_p99_s"], 0)


def _main():
    """Runs the tests; under Bazel also writes one JUnit case per test to
    $XML_OUTPUT_FILE, so each counts in CI's summary."""
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__])
    tests = list(_all_tests(suite))  # running the suite empties it
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    path = os.environ.get("XML_OUTPUT_FILE")
    if path:
        import xml.etree.ElementTree as ET
        root = ET.Element("testsuites")
        ts = ET.SubElement(root, "testsuite", name="kvferry_test", tests=str(result.testsRun))
        failed = {t.id(): msg for t, msg in result.failures + result.errors}
        skipped = {t.id(): msg for t, msg in result.skipped}
        for test in tests:
            case = ET.SubElement(ts, "testcase", name=test.id(), classname="kvferry_test")
            if test.id() in failed:
                ET.SubElement(case, "failure", message="failed").text = failed[test.id()]
            elif test.id() in skipped:
                ET.SubElement(case, "skipped", message=skipped[test.id()])
        ET.ElementTree(root).write(path)
    return 0 if result.wasSuccessful() else 1


def _all_tests(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _all_tests(t)
        else:
            yield t


if __name__ == "__main__":
    sys.exit(_main())
