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


if __name__ == "__main__":
    unittest.main()
