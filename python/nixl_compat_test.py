"""The `nixl` stand-in (kvferry_compat --nixl): NIXL's surface as vLLM,
Dynamo and TensorRT-LLM call it (names, defaults, results, exceptions),
its behaviour between two agents, and vLLM's NixlConnector sequence in
separate processes: pull, push, prefill TP 2 against decode TP 1, and a
prefill that dies."""
import array
import ctypes
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvferry_compat  # noqa: E402

_TARGET = tempfile.mkdtemp(prefix="kvferry-nixl-")
kvferry_compat.install(_TARGET, "nixl")
sys.path.insert(0, _TARGET)
os.environ.setdefault("KVFERRY_HOST", "127.0.0.1")
# Pull mode READs the prefill's memory: peers read only with a secret.
os.environ.setdefault("KVFERRY_SECRET", "nixl-test-secret-0123456789")

import nixl  # noqa: E402
import nixl._api as api  # noqa: E402
import nixl._bindings as bindings  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

SCRIPT = os.path.join(HERE, "nixl_style", "vllm_shape.py")

# NIXL 1.4's nixl_agent methods and their parameters with defaults
# (reference: nixl-api.md §6; "=" marks a default).
METHODS = {
    "get_plugin_list": "", "get_plugin_params": "backend", "get_plugin_mem_types": "backend",
    "get_backend_params": "backend", "get_backend_mem_types": "backend",
    "create_backend": "backend initParams={}",
    "get_reg_descs": "descs mem_type=None", "get_xfer_descs": "descs mem_type=None",
    "register_memory": "reg_list mem_type=None backends=[]",
    "deregister_memory": "dereg_list backends=[]",
    "query_memory": "reg_list backend mem_type=None",
    "make_connection": "remote_agent backends=[]",
    "prep_xfer_dlist": "agent_name xfer_list mem_type=None backends=[]",
    "make_prepped_xfer": "operation local_xfer_side local_indices remote_xfer_side "
                         "remote_indices notif_msg=b'' backends=[] skip_desc_merge=False",
    "initialize_xfer": "operation local_descs remote_descs remote_agent notif_msg=b'' "
                       "backends=[]",
    "transfer": "handle notif_msg=b''", "check_xfer_state": "handle",
    "get_xfer_telemetry": "handle", "estimate_xfer_cost": "req_handle",
    "query_xfer_backend": "handle", "release_xfer_handle": "handle",
    "release_dlist_handle": "handle", "get_new_notifs": "backends=[]",
    "update_notifs": "backends=[]",
    "check_remote_xfer_done": "remote_agent_name lookup_tag backends=[] tag_is_prefix=True",
    "send_notif": "remote_agent_name notif_msg backend=None",
    "get_agent_metadata": "",
    "get_partial_agent_metadata": "descs inc_conn_info=False backends=[]",
    "add_remote_agent": "metadata", "remove_remote_agent": "agent",
    "check_remote_metadata": "remote_name descs=None",
}
# What vLLM's NixlConnector calls (its own fake implements exactly these).
VLLM = ("get_reg_descs register_memory deregister_memory get_xfer_descs prep_xfer_dlist "
        "release_dlist_handle get_agent_metadata add_remote_agent remove_remote_agent "
        "make_prepped_xfer transfer check_xfer_state get_xfer_telemetry release_xfer_handle "
        "get_new_notifs send_notif").split()
EXCEPTIONS = ("nixlNotPostedError nixlInvalidParamError nixlBackendError nixlNotFoundError "
              "nixlMismatchError nixlNotAllowedError nixlRepostActiveError nixlUnknownError "
              "nixlNotSupportedError nixlRemoteDisconnectError nixlCancelledError "
              "nixlNoTelemetryError").split()


def signature_text(fn):
    parts = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # past self
        parts.append(p.name if p.default is inspect.Parameter.empty else
                     f"{p.name}={p.default!r}")
    return " ".join(parts)


class Tensor:
    """What NIXL reads of a torch tensor."""
    def __init__(self, nbytes, cuda=False, device=0):
        self.buf = (ctypes.c_char * nbytes)()
        self.is_cuda = cuda
        self._device = device

    def data_ptr(self):
        return ctypes.addressof(self.buf)

    def numel(self):
        return len(self.buf)

    def element_size(self):
        return 1

    def is_contiguous(self):
        return True

    def get_device(self):
        return self._device if self.is_cuda else -1


class Int64Array(array.array):
    """An int64 numpy array's shape (the buffer protocol and .shape)."""
    def __new__(cls, values):
        a = super().__new__(cls, "q", values)
        a.shape = (len(a),)
        return a


class SurfaceTest(unittest.TestCase):
    def test_every_method_with_nixls_parameters_and_defaults(self):
        for name, params in METHODS.items():
            fn = getattr(nixl_agent, name, None)
            self.assertTrue(callable(fn), name)
            self.assertEqual(signature_text(fn), params, name)
        for name in VLLM:
            self.assertIn(name, METHODS)

    def test_config_agent_and_package_names(self):
        self.assertEqual(signature_text(nixl_agent_config.__init__),
                         "enable_prog_thread=True enable_listen_thread=False listen_port=8888 "
                         "capture_telemetry=False num_threads=0 backends=['UCX'] sync_mode=None")
        self.assertEqual(signature_text(nixl_agent.__init__),
                         "agent_name nixl_conf=None instantiate_all=False")
        c = nixl_agent_config(num_threads=4, capture_telemetry=True)
        self.assertEqual((c.backends, c.enable_pthread, c.enable_listen, c.port,
                          c.capture_telemetry, c.num_threads, c.sync_mode),
                         (["UCX"], True, False, 8888, True, 4, None))
        with self.assertRaises(TypeError):
            nixl_agent_config(sync_mode="STRICT")
        for name in ("DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
                     "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle"):
            self.assertTrue(hasattr(nixl, name), name)
        self.assertEqual(nixl.DEFAULT_COMM_PORT, 8888)
        self.assertIs(api.nixl_agent, nixl.nixl_agent)
        t = bindings.nixlXferTelemetry()
        for f in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount"):
            self.assertEqual(getattr(t, f), 0)
        for name in EXCEPTIONS:
            cls = getattr(bindings, name)
            self.assertTrue(issubclass(cls, Exception) and not issubclass(cls, RuntimeError),
                            name)
        with self.assertRaises(ValueError):
            nixl_agent("")

    def test_installer_refuses_a_real_nixl_and_removes_only_its_own(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "nixl"))
            with open(os.path.join(d, "nixl", "__init__.py"), "w") as f:
                f.write("# the real one\n")
            with self.assertRaises(SystemExit):
                kvferry_compat.install(d, "nixl")
            with self.assertRaises(SystemExit):
                kvferry_compat.uninstall(d, "nixl")
        with tempfile.TemporaryDirectory() as d:
            package = kvferry_compat.install(d, "nixl")
            for f in ("__init__.py", "_api.py", "_bindings.py", "_utils.py"):
                self.assertTrue(os.path.exists(os.path.join(package, f)), f)
            self.assertEqual(kvferry_compat.uninstall(d, "nixl"), package)
            self.assertFalse(os.path.exists(package))


class TwoAgents(unittest.TestCase):
    """Two agents in this process: D (self.d) reads from / writes to P."""
    BLOCK, BLOCKS = 4096, 32

    @classmethod
    def setUpClass(cls):
        conf = nixl_agent_config(num_threads=4, capture_telemetry=True)
        cls.p = nixl_agent("prefill-agent", conf)
        cls.d = nixl_agent(b"decode-agent", conf)  # names as bytes too
        cls.p_mem = (ctypes.c_char * (cls.BLOCK * cls.BLOCKS))()
        cls.d_mem = (ctypes.c_char * (cls.BLOCK * cls.BLOCKS))()
        for i in range(cls.BLOCKS):
            cls.p_mem[i * cls.BLOCK:(i + 1) * cls.BLOCK] = bytes([i + 1]) * cls.BLOCK
        cls.p_reg = cls.p.register_memory(
            [(ctypes.addressof(cls.p_mem), len(cls.p_mem), 0, "")], "DRAM")
        cls.d.register_memory(cls.d.get_reg_descs(
            [(ctypes.addressof(cls.d_mem), len(cls.d_mem), 0, "")], "DRAM"), backends=["UCX"])
        cls.name = cls.d.add_remote_agent(cls.p.get_agent_metadata())
        cls.local = cls.d.prep_xfer_dlist("NIXL_INIT_AGENT", cls.blocks(cls.d_mem))
        cls.remote = cls.d.prep_xfer_dlist(cls.name, cls.blocks(cls.p_mem))

    @classmethod
    def blocks(cls, mem):
        base = ctypes.addressof(mem)
        return cls.d.get_xfer_descs([(base + i * cls.BLOCK, cls.BLOCK, 0)
                                     for i in range(cls.BLOCKS)], "DRAM")

    def wait(self, agent, handle):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if agent.check_xfer_state(handle) == "DONE":
                return
            time.sleep(0.001)
        self.fail("transfer not done in 20 s")

    def test_add_remote_agent_returns_bytes_and_checks(self):
        self.assertEqual(self.name, b"prefill-agent")
        self.assertEqual(self.d.add_remote_agent(self.p.get_agent_metadata()), b"prefill-agent")
        with self.assertRaises(bindings.nixlInvalidParamError):
            self.d.add_remote_agent(self.d.get_agent_metadata())
        with self.assertRaises(bindings.nixlMismatchError):
            self.d.add_remote_agent(b"not metadata")
        self.assertTrue(self.d.check_remote_metadata("prefill-agent"))
        self.assertTrue(self.d.check_remote_metadata(b"prefill-agent"))
        with self.assertRaises(bindings.nixlNotSupportedError):
            self.d.fetch_remote_metadata("x", "127.0.0.1")

    def test_scattered_read_with_notification_and_telemetry(self):
        ctypes.memset(self.d_mem, 0, len(self.d_mem))
        lids, rids = Int64Array([0, 1, 2, 9]), Int64Array([5, 6, 7, 20])
        h = self.d.make_prepped_xfer("READ", self.local, lids, self.remote, rids,
                                     notif_msg=b"req-7:1")
        with self.assertRaises(bindings.nixlNotPostedError):
            self.d.check_xfer_state(h)
        self.assertIn(self.d.transfer(h), ("DONE", "PROC"))
        self.wait(self.d, h)
        self.assertEqual(self.d.check_xfer_state(h), "DONE")  # sticky
        for lb, rb in zip(lids, rids):
            self.assertEqual(self.d_mem[lb * self.BLOCK:(lb + 1) * self.BLOCK],
                             bytes([rb + 1]) * self.BLOCK)
        t = self.d.get_xfer_telemetry(h)
        self.assertEqual(t.totalBytes, 4 * self.BLOCK)
        self.assertEqual(t.descCount, 2)  # 0-2 <- 5-7 merged, 9 <- 20
        self.assertGreaterEqual(t.xferDuration, t.postDuration)
        got = {}
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = self.p.get_new_notifs()
            time.sleep(0.005)
        self.assertEqual(got, {"decode-agent": [b"req-7:1"]})
        self.d.release_xfer_handle(h)
        self.d.release_xfer_handle(h)  # twice: nothing
        # The same pairs without merging: one descriptor each.
        h = self.d.make_prepped_xfer("READ", self.local, [0, 1, 2], self.remote, [5, 6, 7],
                                     skip_desc_merge=True)
        self.d.transfer(h)
        self.wait(self.d, h)
        self.assertEqual(self.d.get_xfer_telemetry(h).descCount, 3)
        self.d.release_xfer_handle(h)

    def test_bad_input_raises_nixls_errors(self):
        with self.assertRaises(bindings.nixlInvalidParamError):
            self.d.make_prepped_xfer("READ", self.local, [0], self.remote, [self.BLOCKS])
        with self.assertRaises(bindings.nixlInvalidParamError):
            self.d.make_prepped_xfer("READ", self.local, [0, 1], self.remote, [0])
        with self.assertRaises(bindings.nixlInvalidParamError):
            self.d.make_prepped_xfer("READ", self.remote, [0], self.local, [0])
        with self.assertRaises(KeyError):
            self.d.make_prepped_xfer("COPY", self.local, [0], self.remote, [0])
        stray = (ctypes.c_char * 4096)()
        with self.assertRaises(bindings.nixlNotFoundError):
            self.d.prep_xfer_dlist("", [(ctypes.addressof(stray), 4096, 0)], "DRAM")
        with self.assertRaises(bindings.nixlNotFoundError):
            self.d.prep_xfer_dlist("nobody", self.blocks(self.p_mem))
        self.assertIsNone(self.d.get_reg_descs([(1, 2, 0)], "DRAM"))  # 3-tuples
        self.assertIsNone(self.d.get_reg_descs([(1, 2, 0, "")]))  # no mem type
        self.assertIsNone(self.d.get_xfer_descs([(1, 2, 0, "")], "DRAM"))
        with self.assertRaises(KeyError):
            self.d.get_xfer_descs([(1, 2, 0)], "HBM")
        with self.assertRaises(bindings.nixlNoTelemetryError):
            nixl_agent("quiet").get_xfer_telemetry(None)

    def test_dynamo_shape_keywords_cpu_and_tensors(self):
        # Dynamo: nixl_agent(id), register_memory(tensor), initialize_xfer
        # with keywords and "cpu", transfer(h, bytes), update_notifs.
        worker = nixl_agent("dynamo-worker")
        mine = Tensor(2 * self.BLOCK)
        reg = worker.register_memory(mine)
        self.assertEqual(reg.getType(), bindings.DRAM_SEG)
        name = worker.add_remote_agent(self.p.get_agent_metadata())
        self.assertIsInstance(name, bytes)
        local = worker.get_xfer_descs(descs=[(mine.data_ptr(), self.BLOCK, 0)], mem_type="cpu")
        remote = worker.get_xfer_descs(
            descs=[(ctypes.addressof(self.p_mem) + 3 * self.BLOCK, self.BLOCK, 0)],
            mem_type="cpu")
        h = worker.initialize_xfer(operation="READ", local_descs=local, remote_descs=remote,
                                   remote_agent=name.decode(), notif_msg=b"uuid-42")
        worker.transfer(h, b"uuid-42")
        self.wait(worker, h)
        self.assertEqual(bytes(mine.buf[:self.BLOCK]), bytes([4]) * self.BLOCK)
        deadline = time.monotonic() + 10
        while not self.p.check_remote_xfer_done("dynamo-worker", b"uuid-42") and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        self.assertLess(time.monotonic(), deadline)
        worker.release_xfer_handle(h)
        worker.remove_remote_agent(name)
        worker.deregister_memory(reg)

    def test_a_removed_agents_transfers_fail_not_found(self):
        a = nixl_agent("short-lived")
        mem = (ctypes.c_char * self.BLOCK)()
        a.register_memory([(ctypes.addressof(mem), self.BLOCK, 0, "")], "DRAM")
        name = a.add_remote_agent(self.p.get_agent_metadata())
        local = a.prep_xfer_dlist("", [(ctypes.addressof(mem), self.BLOCK, 0)], "DRAM")
        remote = a.prep_xfer_dlist(name, [(ctypes.addressof(self.p_mem), self.BLOCK, 0)], "DRAM")
        h = a.make_prepped_xfer("READ", local, [0], remote, [0])
        a.remove_remote_agent(name)
        a.remove_remote_agent(name)  # never raises
        with self.assertRaises(bindings.nixlNotFoundError):
            a.transfer(h)
        a.add_remote_agent(self.p.get_agent_metadata())  # a new generation
        with self.assertRaises(bindings.nixlNotFoundError):
            a.transfer(h)
        with self.assertRaises(bindings.nixlNotFoundError):
            a.send_notif("nobody", notif_msg=b"x")

    def test_three_threads_on_one_agent(self):
        # vLLM's engine, handshake and push-writer threads, no locking.
        ctypes.memset(self.d_mem, 0, len(self.d_mem))
        self.p.get_new_notifs()  # what earlier tests left
        errors = []

        def worker(t):
            try:
                for i in range(15):
                    lid = (t * 7 + i) % self.BLOCKS
                    h = self.d.make_prepped_xfer("READ", self.local, [lid], self.remote, [lid],
                                                 notif_msg=f"t{t}-{i}:1".encode())
                    self.d.transfer(h)
                    self.wait(self.d, h)
                    self.d.get_xfer_telemetry(h)
                    self.d.release_xfer_handle(h)
                    self.d.get_new_notifs()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(errors, [])
        for lid in {(t * 7 + i) % self.BLOCKS for t in range(3) for i in range(15)}:
            span = slice(lid * self.BLOCK, (lid + 1) * self.BLOCK)
            self.assertEqual(self.d_mem[span], self.p_mem[span], lid)
        seen = 0
        deadline = time.monotonic() + 10
        while seen < 45 and time.monotonic() < deadline:
            seen += sum(len(v) for v in self.p.get_new_notifs().values())
            time.sleep(0.005)
        self.assertEqual(seen, 45)


def run_vllm(test, prefill_args_list, decode_args, kill_prefill=False, timeout=120):
    """The prefill processes, then the decode; returns (decode rc, output,
    the prefills' outputs)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_TARGET, HERE]))
    prefills, ports = [], []
    try:
        for args in prefill_args_list:
            p = subprocess.Popen([sys.executable, SCRIPT, "prefill"] + args, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            prefills.append(p)
            line = p.stdout.readline()
            test.assertTrue(line.startswith("SIDE "), line)
            ports.append(line.split()[1])
        d = subprocess.Popen([sys.executable, SCRIPT, "decode", "--prefills", ",".join(ports)] +
                             decode_args, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if kill_prefill:
            test.assertEqual(d.stdout.readline().strip(), "READY")
            for p in prefills:
                p.send_signal(signal.SIGKILL)
                p.wait()
            d.stdin.write("go\n")
            d.stdin.flush()
        out, err = d.communicate(timeout=timeout)
        outs = [p.communicate(timeout=timeout)[0] if not kill_prefill else ""
                for p in prefills]
        return d.returncode, out, outs, err
    finally:
        for p in prefills:
            if p.poll() is None:
                p.kill()
                p.wait()


class VllmSequence(unittest.TestCase):
    def test_pull(self):
        rc, out, (p_out,), err = run_vllm(self, [[]], [])
        self.assertEqual(rc, 0, out + err[-2000:])
        self.assertIn("OK 6 requests", out)
        self.assertEqual(sorted(l for l in p_out.splitlines() if l.startswith("FREED")),
                         [f"FREED {i}" for i in range(6)])

    def test_push(self):
        rc, out, (p_out,), err = run_vllm(self, [["--push"]], ["--push"])
        self.assertEqual(rc, 0, out + err[-2000:])
        self.assertIn("OK 6 requests", out)
        self.assertEqual(sum(l.startswith("PUSHED") for l in p_out.splitlines()), 6)

    def test_prefill_tp2_decode_tp1(self):
        rc, out, outs, err = run_vllm(self, [["--rank", "0"], ["--rank", "1"]], [])
        self.assertEqual(rc, 0, out + err[-2000:])
        self.assertIn("OK 6 requests", out)
        for p_out in outs:
            self.assertEqual(sum(l.startswith("FREED") for l in p_out.splitlines()), 6)

    def test_a_killed_prefill_fails_its_requests_in_bounded_time(self):
        start = time.monotonic()
        rc, out, _, err = run_vllm(self, [[]], ["--wait-for-go", "--expect-failure",
                                                "--timeout", "40"], kill_prefill=True)
        self.assertEqual(rc, 0, out + err[-2000:])
        self.assertIn("FAILED-CLEANLY", out)
        self.assertLess(time.monotonic() - start, 60)


if __name__ == "__main__":
    unittest.main()
