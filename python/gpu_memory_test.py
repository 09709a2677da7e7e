"""GPU memory from Python, through the fake CUDA driver (//cuda/testing):
register_memory takes device pointers (as torch's data_ptr() gives them),
the Mooncake-compatible engine takes location=, and the bytes move between
two engines without the CPU touching device memory (the fake maps it
PROT_NONE). Runs in its own process: the driver is chosen once per process."""
import ctypes
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "..", "cuda", "testing", "libfakecuda.so")
os.environ["KVFERRY_CUDA_LIBRARY"] = os.path.abspath(FAKE)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import kvferry  # noqa: E402


class FakeCuda:
    """Device memory through the fake driver's entry points (the same ones a
    real libcuda exports), as a framework would allocate it."""

    def __init__(self):
        self.lib = ctypes.CDLL(os.path.abspath(FAKE))
        assert self.lib.cuInit(0) == 0
        self.ctx = {}

    def use(self, ordinal):
        if ordinal not in self.ctx:
            ctx = ctypes.c_void_p()
            assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal) == 0
            self.ctx[ordinal] = ctx
        assert self.lib.cuCtxSetCurrent(self.ctx[ordinal]) == 0

    def alloc(self, ordinal, size):
        self.use(ordinal)
        ptr = ctypes.c_ulonglong()
        assert self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)) == 0
        return ptr.value

    def put(self, ordinal, dst, array, sync=True):
        """A plain cuMemcpy from pageable memory may return before the copy
        ran (the fake, like the driver, lands it later): a caller without a
        stream synchronizes before handing the memory to kvferry."""
        self.use(ordinal)
        assert self.lib.cuMemcpy(ctypes.c_ulonglong(dst), ctypes.c_ulonglong(array.ctypes.data),
                                 ctypes.c_size_t(array.nbytes)) == 0
        if sync:
            assert self.lib.cuCtxSynchronize() == 0

    def get(self, ordinal, src, size):
        self.use(ordinal)
        out = np.zeros(size, dtype=np.uint8)
        assert self.lib.cuMemcpy(ctypes.c_ulonglong(out.ctypes.data), ctypes.c_ulonglong(src),
                                 ctypes.c_size_t(size)) == 0
        return out


    def stream(self, ordinal):
        self.use(ordinal)
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        return s.value

    def pinned(self, size):
        p = ctypes.c_void_p()
        assert self.lib.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(size), 0) == 0
        return p.value

    def put_async(self, ordinal, dst, src, size, stream):
        self.use(ordinal)
        assert self.lib.cuMemcpyAsync(ctypes.c_ulonglong(dst), ctypes.c_ulonglong(src),
                                      ctypes.c_size_t(size), ctypes.c_void_p(stream)) == 0

    def sync(self, ordinal, stream):
        self.use(ordinal)
        assert self.lib.cuStreamSynchronize(ctypes.c_void_p(stream)) == 0


class GpuMemoryTest(unittest.TestCase):
    def test_device_pointers_move_between_engines(self):
        cuda = FakeCuda()
        size = 3 << 20
        src = cuda.alloc(0, size)
        dst = cuda.alloc(1, size)
        data = (np.arange(size, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
        cuda.put(0, src, data)
        prefill = kvferry.Engine(host="127.0.0.1", transport="tcp")
        decode = kvferry.TransferEngine()
        self.assertEqual(decode.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        prefill.register_memory(src, size)  # no location: the driver says
        self.assertEqual(decode.register_memory(dst, size, location="cuda:1"), 0)
        peer = "127.0.0.1:%d" % decode.get_rpc_port()
        prefill.transfer(peer, [("write", src, dst, size)], timeout=30)
        self.assertTrue(np.array_equal(cuda.get(1, dst, size), data))

    def test_stream_ordered_calls_wait_for_the_streams_earlier_work(self):
        """Mooncake's *_on_cuda: the write starts after the copy still
        pending on the stream (so the peer gets what it writes, not what the
        buffer held before), and the stream's synchronization comes after
        the transfer."""
        self.assertTrue(kvferry.SUPPORT_CUDA)
        cuda = FakeCuda()
        size = 1 << 20
        src = cuda.alloc(0, size)
        dst = cuda.alloc(1, 2 * size)
        back = cuda.alloc(0, size)
        before = np.full(size, 7, dtype=np.uint8)
        cuda.put(0, src, before)
        after = (np.arange(size, dtype=np.uint64) * 40503 % 253).astype(np.uint8)
        host = cuda.pinned(size)
        ctypes.memmove(host, after.ctypes.data, size)
        prefill = kvferry.TransferEngine()
        decode = kvferry.TransferEngine()
        for e in (prefill, decode):
            self.assertEqual(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        self.assertEqual(prefill.register_memory(src, size), 0)
        self.assertEqual(prefill.register_memory(back, size, access="none"), 0)
        self.assertEqual(decode.register_memory(dst, 2 * size, access="rw"), 0)
        peer = "127.0.0.1:%d" % decode.get_rpc_port()
        stream = cuda.stream(0)
        cuda.put_async(0, src, host, size, stream)  # the "kernel" writing the layer
        self.assertIsNone(prefill.transfer_write_on_cuda(peer, src, dst, size, stream_ptr=stream))
        prefill.batch_transfer_write_on_cuda(peer, [src, src + 4096], [dst + size, dst + size + 8192],
                                             [4096, 4096], stream)
        cuda.sync(0, stream)
        got = cuda.get(1, dst, 2 * size)
        self.assertTrue(np.array_equal(got[:size], after))
        self.assertTrue(np.array_equal(got[size:size + 4096], after[:4096]))
        self.assertTrue(np.array_equal(got[size + 8192:size + 12288], after[4096:8192]))
        # And back, stream-ordered READs.
        prefill.transfer_read_on_cuda(peer, back, dst, 4096, stream)
        prefill.batch_transfer_read_on_cuda(peer, [back + 4096], [dst + 4096], [size - 4096],
                                            stream_ptr=stream)
        cuda.sync(0, stream)
        self.assertTrue(np.array_equal(cuda.get(0, back, size), after))
        with self.assertRaisesRegex(RuntimeError, "differ in count"):
            prefill.batch_transfer_write_on_cuda(peer, [src], [], [8], stream)

    def test_a_location_that_contradicts_the_memory_is_refused(self):
        cuda = FakeCuda()
        dev = cuda.alloc(1, 1 << 16)
        engine = kvferry.TransferEngine()
        self.assertEqual(engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), 0)
        self.assertEqual(engine.register_memory(dev, 1 << 16, location="cuda:0"), -1)
        self.assertIn("cuda:1", engine.get_last_error())
        self.assertEqual(engine.register_memory(dev, 1 << 16, "*"), 0)  # Mooncake's wildcard
        native = kvferry.Engine(host="127.0.0.1", transport="tcp")
        with self.assertRaises(Exception):
            native.register_memory(dev, 1 << 16, location="cpu:0")


class NixlOnDeviceMemoryTest(unittest.TestCase):
    """The `nixl` stand-in with VRAM: vLLM's registration of device memory
    and a prepared READ between two GPUs' blocks."""

    def test_vram_blocks_read_through_prepared_lists(self):
        import tempfile
        import kvferry_compat
        target = tempfile.mkdtemp(prefix="kvferry-nixl-gpu-")
        kvferry_compat.install(target, "nixl")
        sys.path.insert(0, target)
        os.environ.setdefault("KVFERRY_HOST", "127.0.0.1")
        os.environ.setdefault("KVFERRY_SECRET", "gpu-test-secret-0123456789")
        from nixl._api import nixl_agent, nixl_agent_config
        cuda = FakeCuda()
        block, blocks = 4096, 8
        p_dev, d_dev = cuda.alloc(0, block * blocks), cuda.alloc(1, block * blocks)
        data = (np.arange(block * blocks) % 253).astype(np.uint8)
        cuda.put(0, p_dev, data)
        cuda.put(1, d_dev, np.zeros(block * blocks, dtype=np.uint8))
        conf = nixl_agent_config(num_threads=4, capture_telemetry=True)
        p, d = nixl_agent("gpu-prefill", conf), nixl_agent("gpu-decode", conf)
        p.register_memory(p.get_reg_descs([(p_dev, block * blocks, 0, "")], "VRAM"))
        d.register_memory(d.get_reg_descs([(d_dev, block * blocks, 1, "")], "VRAM"))
        name = d.add_remote_agent(p.get_agent_metadata())
        rows = lambda base, dev: np.array([(base + i * block, block, dev)  # noqa: E731
                                           for i in range(blocks)], dtype=np.uint64)
        local = d.prep_xfer_dlist("NIXL_INIT_AGENT", d.get_xfer_descs(rows(d_dev, 1), "VRAM"))
        remote = d.prep_xfer_dlist(name, d.get_xfer_descs(rows(p_dev, 0), "VRAM"))
        lids = np.array([0, 1, 2, 7], dtype=np.int64)
        rids = np.array([5, 6, 7, 0], dtype=np.int64)
        h = d.make_prepped_xfer("READ", local, lids, remote, rids, notif_msg=b"gpu:1")
        d.transfer(h)
        for _ in range(20000):
            if d.check_xfer_state(h) == "DONE":
                break
        self.assertEqual(d.check_xfer_state(h), "DONE")
        self.assertEqual(d.get_xfer_telemetry(h).descCount, 2)  # 0-2 <- 5-7, 7 <- 0
        got = cuda.get(1, d_dev, block * blocks)
        for lb, rb in zip(lids, rids):
            np.testing.assert_array_equal(got[lb * block:(lb + 1) * block],
                                          data[rb * block:(rb + 1) * block])
        d.release_xfer_handle(h)


if __name__ == "__main__":
    unittest.main()
