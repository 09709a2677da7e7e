"""kvferry.TransferEngine as Mooncake's Python engine: every method, the
fallbacks and environment at initialize, IPv6 hosts, the opt-in
`mooncake.engine` stand-in, and the Mooncake-style script run through it."""
import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvferry  # noqa: E402
import kvferry_compat  # noqa: E402

# Mooncake's TransferEngine methods (transfer_engine_py.cpp, builds without
# CUDA): the whole surface serving code can call.
MOONCAKE_METHODS = """
initialize initialize_ext get_rpc_port allocate_managed_buffer free_managed_buffer
transfer_sync_write transfer_sync_read batch_transfer_sync_write batch_transfer_sync_read
batch_transfer_async_write batch_transfer_async_read transfer_sync batch_transfer_sync
batch_transfer_async get_batch_transfer_status transfer_submit_write transfer_check_status
write_bytes_to_buffer read_bytes_from_buffer register_memory unregister_memory
batch_register_memory batch_unregister_memory get_local_topology get_first_buffer_address
warmup_efa_segment get_notifies send_probe get_engine get_engine_ptr
""".split()
SCRIPT = os.path.join(HERE, "mooncake_style", "every_method.py")
BENCH = os.path.join(HERE, "mooncake_style", "threads_bench.py")


def has_rdma():
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def initialize_in_child(env_extra, protocol="rdma", device="", host="127.0.0.1"):
    """initialize() in a fresh process with `env_extra`: (return value,
    transport or last error, stderr)."""
    code = (
        "import sys, kvferry\n"
        "e = kvferry.TransferEngine()\n"
        f"r = e.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, {device!r})\n"
        "print(r)\n"
        "print(e.get_engine().transport if r == 0 else e.get_last_error())\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MC_") and k != "KVFERRY_REQUIRE_RDMA"}
    env.update(env_extra)
    env["PYTHONPATH"] = HERE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = out.stdout.splitlines()
    return int(lines[0]), lines[1] if len(lines) > 1 else "", out.stderr


class SurfaceTest(unittest.TestCase):
    def test_every_mooncake_method_exists_and_the_script_calls_it(self):
        with open(SCRIPT, encoding="utf-8") as f:
            script = f.read()
        for name in MOONCAKE_METHODS:
            self.assertTrue(callable(getattr(kvferry.TransferEngine, name, None)), name)
            self.assertIn(f".{name}(", script, f"every_method.py never calls {name}")

    def test_enums_and_classes_callers_import(self):
        self.assertEqual(int(kvferry.TransferOpcode.Read), 0)
        self.assertEqual(int(kvferry.TransferOpcode.Write), 1)
        self.assertIs(kvferry.TransferEngine.TransferOpcode, kvferry.TransferOpcode)
        n = kvferry.TransferNotify("a", "b")
        self.assertEqual((n.name, n.msg), ("a", "b"))
        # True exactly where a CUDA driver loads (none here unless the host has one).
        try:
            ctypes.CDLL("libcuda.so.1")
            has_driver = "KVFERRY_CUDA_LIBRARY" not in os.environ or bool(os.environ["KVFERRY_CUDA_LIBRARY"])
        except OSError:
            has_driver = bool(os.environ.get("KVFERRY_CUDA_LIBRARY"))
        if not has_driver:
            self.assertFalse(kvferry.SUPPORT_CUDA)
            with self.assertRaisesRegex(RuntimeError, "CUDA driver"):
                e = kvferry.TransferEngine()
                self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
                e.transfer_write_on_cuda("127.0.0.1:%d" % e.get_rpc_port(), 0, 0, 8, 0)

    def test_an_unspecified_local_hostname_advertises_a_real_address(self):
        e = kvferry.TransferEngine()
        self.assertEqual(e.initialize("0.0.0.0", "P2PHANDSHAKE", "tcp", ""), 0, e.get_last_error())
        address = e.get_engine().address
        self.assertFalse(address.startswith("0.0.0.0:"), address)
        self.assertEqual(int(address.rsplit(":", 1)[1]), e.get_rpc_port())

    def test_keyword_arguments_and_last_error_reset(self):
        e = kvferry.TransferEngine()
        self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        buf = (ctypes.c_char * 8192)()
        addr = ctypes.addressof(buf)
        self.assertEqual(e.register_memory(addr, 8192, location="cpu:0"), 0)
        self.assertEqual(e.register_memory(addr, 8192, location="*"), -1)  # overlaps
        self.assertIn("overlaps", e.get_last_error())
        self.assertGreater(e.get_rpc_port(), 0)
        self.assertEqual(e.get_last_error(), "", "a success clears the last error")
        # In-process write to itself with Mooncake's keyword arguments.
        buf[0:4] = b"abcd"
        self.assertEqual(e.transfer_sync_write(target_hostname=e.get_local_address(),
                                               buffer=addr, peer_buffer_address=addr + 4096,
                                               length=4, transport_hint="rdma"), 0)
        self.assertEqual(buf[4096:4100], b"abcd")
        self.assertEqual(e.transfer_check_status(12345), -1)
        self.assertIn("unknown batch", e.get_last_error())
        self.assertEqual(e.batch_transfer_async_write("127.0.0.1:1", [addr], [0], [1]), 0)
        self.assertEqual(e.transfer_submit_write("127.0.0.1:1", addr, 0, 1), 0)
        self.assertEqual(e.free_managed_buffer(addr, 8192), -1)
        self.assertIn("not from allocate_managed_buffer", e.get_last_error())
        self.assertEqual(e.write_bytes_to_buffer(addr, b"xy", 3), -1)  # longer than given
        # Raw pointers outside registered memory are refused, not followed
        # (they used to crash the process).
        self.assertEqual(e.write_bytes_to_buffer(8, b"xy", 2), -1)
        self.assertIn("not inside memory registered", e.get_last_error())
        self.assertEqual(e.read_bytes_from_buffer(8, 16), b"")
        self.assertIn("not inside memory registered", e.get_last_error())
        self.assertEqual(e.read_bytes_from_buffer(addr + 8190, 4), b"")  # runs past the end
        self.assertEqual(e.write_bytes_to_buffer(addr + 8, b"xy", 2), 0)
        self.assertEqual(e.read_bytes_from_buffer(addr + 8, 2), b"xy")
        self.assertEqual(e.unregister_memory(addr), 0)
        self.assertEqual(e.read_bytes_from_buffer(addr, 2), b"")  # no longer registered

    def test_uninitialized_and_bad_arguments(self):
        e = kvferry.TransferEngine()
        self.assertEqual(e.get_rpc_port(), -1)
        self.assertIn("initialize", e.get_last_error())
        self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", ""), -1)
        self.assertIn("nvlink", e.get_last_error())
        self.assertEqual(e.initialize("[::1", "P2PHANDSHAKE", "tcp", ""), -1)
        self.assertIn("brackets", e.get_last_error())
        self.assertEqual(e.initialize_ext("127.0.0.1", "10.0.0.1:2379", "tcp", "", "etcd"), -1)
        self.assertIn("P2PHANDSHAKE", e.get_last_error())


class DefectTest(unittest.TestCase):
    """Defects found by running other people's Mooncake code on kvferry."""

    def test_every_support_flag_mooncake_defines(self):
        for flag in ("SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_INTRA_NVLINK",
                     "SUPPORT_CUDA", "SUPPORT_MUSA"):
            self.assertIsInstance(getattr(kvferry, flag, None), bool, flag)
            self.assertIn(flag, kvferry_compat._ENGINE, f"mooncake.engine lacks {flag}")
        self.assertFalse(kvferry.SUPPORT_MUSA)

    def test_first_buffer_address_of_the_own_segment_is_live(self):
        e = kvferry.TransferEngine()
        self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        me = e.get_local_address()
        a, b = (ctypes.c_char * 8192)(), (ctypes.c_char * 8192)()
        self.assertEqual(e.get_first_buffer_address(me), 0)  # nothing registered yet
        self.assertEqual(e.register_memory(ctypes.addressof(a), 8192), 0)
        self.assertEqual(e.get_first_buffer_address(me), ctypes.addressof(a))
        self.assertEqual(e.register_memory(ctypes.addressof(b), 8192), 0)
        self.assertEqual(e.get_first_buffer_address(me), ctypes.addressof(a))  # the first
        self.assertEqual(e.unregister_memory(ctypes.addressof(a)), 0)
        self.assertEqual(e.get_first_buffer_address(me), ctypes.addressof(b))
        self.assertEqual(e.unregister_memory(ctypes.addressof(b)), 0)

    def _read_from_a_peer(self, env):
        """A server and a client engine made under `env`; the client reads
        the server's buffer (registered with the default access): (return
        value, client's last error, the bytes read)."""
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
        try:
            server, client = kvferry.TransferEngine(), kvferry.TransferEngine()
            for x in (server, client):
                self.assertEqual(x.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
            theirs, mine = (ctypes.c_char * 4096)(), (ctypes.c_char * 4096)()
            theirs[0:6] = b"secret"
            self.assertEqual(server.register_memory(ctypes.addressof(theirs), 4096), 0)
            self.assertEqual(client.register_memory(ctypes.addressof(mine), 4096), 0)
            r = client.transfer_sync_read(server.get_local_address(), ctypes.addressof(mine),
                                          ctypes.addressof(theirs), 6)
            return r, client.get_last_error(), bytes(mine[0:6])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def test_authenticated_peers_may_read_as_in_mooncake(self):
        r, why, got = self._read_from_a_peer({"KVFERRY_SECRET": "0123456789abcdef-test",
                                              "KVFERRY_REMOTE_ACCESS": None})
        self.assertEqual(r, 0, why)
        self.assertEqual(got, b"secret")

    def test_without_a_secret_reads_stay_opt_in_and_the_refusal_says_how(self):
        r, why, got = self._read_from_a_peer({"KVFERRY_SECRET": None,
                                              "KVFERRY_REMOTE_ACCESS": None})
        self.assertEqual(r, -1)
        self.assertIn("KVFERRY_REMOTE_ACCESS=rw", why)
        self.assertEqual(got, bytes(6))  # nothing was read

    def test_rdma_means_rdma_where_both_ends_have_it(self):
        # "rdma" makes an automatic engine, which keeps TCP beside RDMA for
        # peers without it (an engine made for "rdma" alone refuses them).
        code = ("import kvferry\ne = kvferry.TransferEngine()\n"
                "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'rdma', '') == 0\n"
                "print(e.get_engine().transport_reason)\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MC_") and k != "KVFERRY_REQUIRE_RDMA"}
        env["PYTHONPATH"] = HERE
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        reason = out.stdout.strip()
        self.assertNotIn("set explicitly", reason)
        if has_rdma():
            self.assertIn("TCP beside it for peers RDMA cannot reach", reason)
        else:
            self.assertTrue("no RDMA devices" in reason or "not found" in reason
                            or "no usable RDMA port" in reason, reason)


class FallbackTest(unittest.TestCase):
    @unittest.skipIf(has_rdma(), "this host has RDMA: rdma does not fall back")
    def test_rdma_without_a_device_falls_back_to_tcp_with_one_warning(self):
        r, transport, err = initialize_in_child({})
        self.assertEqual(r, 0, transport + err)
        self.assertEqual(transport, "tcp")
        self.assertEqual(err.count("using TCP instead"), 1, err)

    @unittest.skipIf(has_rdma(), "this host has RDMA")
    def test_a_missing_device_falls_back_to_discovery_then_tcp(self):
        r, transport, err = initialize_in_child({}, device="mlx5_99")
        self.assertEqual(r, 0, transport + err)
        self.assertIn("mlx5_99", err)
        self.assertIn("using the RDMA devices discovery finds", err)

    def test_strict_mode_makes_both_errors(self):
        for env in ({"KVFERRY_REQUIRE_RDMA": "1"}, {"MC_FORCE_HCA": "1"}):
            r, why, err = initialize_in_child(env, device="mlx5_99")
            self.assertEqual(r, -1, why + err)
            self.assertIn("mlx5_99", why)
            self.assertNotIn("using TCP instead", err)

    def test_mc_force_tcp(self):
        r, transport, err = initialize_in_child({"MC_FORCE_TCP": "1"})
        self.assertEqual((r, transport), (0, "tcp"), err)
        self.assertIn("MC_FORCE_TCP", err)
        r, why, _ = initialize_in_child({"MC_FORCE_TCP": "1", "KVFERRY_REQUIRE_RDMA": "1"})
        self.assertEqual(r, -1)
        self.assertIn("contradicts", why)

    def test_mc_variables_are_honoured_or_refused_or_named(self):
        r, why, _ = initialize_in_child({"MC_SLICE_SIZE": "lots"}, protocol="tcp")
        self.assertEqual(r, -1)
        self.assertIn("MC_SLICE_SIZE", why)
        r, why, _ = initialize_in_child({"MC_TRANSFER_TIMEOUT": "30s"}, protocol="tcp")
        self.assertEqual(r, -1)
        self.assertIn("MC_TRANSFER_TIMEOUT", why)
        r, why, _ = initialize_in_child({"MC_MIN_RPC_PORT": "16500", "MC_MAX_RPC_PORT": "16400"},
                                        protocol="tcp")
        self.assertEqual(r, -1)
        self.assertIn("MC_MAX_RPC_PORT", why)
        r, _, err = initialize_in_child({"MC_MAX_WR": "256", "MC_NUM_CQ_PER_CTX": "2"},
                                        protocol="tcp")
        self.assertEqual(r, 0)
        self.assertEqual(err.count("ignoring Mooncake tuning variable(s) MC_MAX_WR, "
                                   "MC_NUM_CQ_PER_CTX"), 1, err)

    def test_rpc_port_range_from_the_environment(self):
        code = ("import kvferry\ne = kvferry.TransferEngine()\n"
                "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
                "print(e.get_rpc_port())\n")
        env = dict(os.environ, PYTHONPATH=HERE, MC_MIN_RPC_PORT="16900", MC_MAX_RPC_PORT="16999")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertTrue(16900 <= int(out.stdout) <= 16999, out.stdout)

    @unittest.skipUnless(has_ipv6_loopback(), "no IPv6 loopback")
    def test_ipv6_hosts_bare_and_bracketed(self):
        for host in ("::1", "[::1]"):
            r, transport, err = initialize_in_child({}, protocol="tcp", host=host)
            self.assertEqual((r, transport), (0, "tcp"), err)


class StandInTest(unittest.TestCase):
    def test_script_runs_through_mooncake_engine(self):
        with tempfile.TemporaryDirectory() as d:
            kvferry_compat.install(d)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, d]),
                       KVFERRY_LOG_LEVEL="warning")
            hosts = ["127.0.0.1"] + (["::1", "[::1]"] if has_ipv6_loopback() else [])
            for host in hosts:
                out = subprocess.run([sys.executable, SCRIPT, "--host", host], env=env,
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(out.returncode, 0, host + out.stdout + out.stderr)
                self.assertIn("every method: OK", out.stdout)

    def test_threads_bench_runs(self):
        # A smoke run of the benchmark (two rounds): it works, whatever its times.
        with tempfile.TemporaryDirectory() as d:
            kvferry_compat.install(d)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, d]),
                       KVFERRY_LOG_LEVEL="warning")
            out = subprocess.run([sys.executable, BENCH, "--rounds", "2", "--layer_kib", "16"],
                                 env=env, capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            self.assertIn("4 threads / 1 thread", out.stdout)

    def test_never_shadows_a_real_mooncake(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "mooncake"))
            with open(os.path.join(d, "mooncake", "__init__.py"), "w") as f:
                f.write("# the real one\n")
            with self.assertRaises(SystemExit):
                kvferry_compat.install(d)
            with self.assertRaises(SystemExit):
                kvferry_compat.uninstall(d)
            with open(os.path.join(d, "mooncake", "__init__.py")) as f:
                self.assertEqual(f.read(), "# the real one\n")

    def test_install_and_uninstall(self):
        with tempfile.TemporaryDirectory() as d:
            package = kvferry_compat.install(d)
            self.assertTrue(os.path.exists(os.path.join(package, "engine.py")))
            self.assertEqual(kvferry_compat.uninstall(d), package)
            self.assertFalse(os.path.exists(package))
            self.assertIsNone(kvferry_compat.uninstall(d))


if __name__ == "__main__":
    unittest.main()
