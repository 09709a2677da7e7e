"""libkvferry.so through ctypes: where it is found, the C prototypes, and
failures turned into kvferry.Error.

The library is looked for, in order: the file KVFERRY_LIBRARY names; next
to this package (the wheel puts it there); the repository layout
(python/kvferry/ -> c/libkvferry.so, as in a Bazel build or its runfiles).
ctypes releases the GIL around every foreign call, so the engine never
waits with it held.
"""
import array
import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


class Error(RuntimeError):
    """A kvferry failure: str() is the engine's message, .code its status
    code's name ("INVALID_ARGUMENT", "UNAVAILABLE", ...)."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


def _candidates():
    named = os.environ.get("KVFERRY_LIBRARY")
    if named:
        yield named
    yield os.path.join(_HERE, "libkvferry.so")
    yield os.path.normpath(os.path.join(_HERE, "..", "..", "c", "libkvferry.so"))
    # Bazel runfiles of a target in another package: <runfiles>/kvferry/c.
    runfiles = os.environ.get("RUNFILES_DIR")
    if runfiles:
        yield os.path.join(runfiles, "kvferry", "c", "libkvferry.so")


def _load():
    tried = []
    for path in _candidates():
        if os.path.exists(path) or path == os.environ.get("KVFERRY_LIBRARY"):
            try:
                return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError as e:
                tried.append(f"{path}: {e}")
        else:
            tried.append(f"{path}: no such file")
    raise ImportError("kvferry: cannot load libkvferry.so (" + "; ".join(tried) + ")")


lib = _load()

c_u64 = ctypes.c_uint64
c_u64_p = ctypes.POINTER(ctypes.c_uint64)
c_u32_p = ctypes.POINTER(ctypes.c_uint32)
c_char_pp = ctypes.POINTER(ctypes.c_void_p)  # char** out (freed with kvferry_free)
c_size_p = ctypes.POINTER(ctypes.c_size_t)
c_int_p = ctypes.POINTER(ctypes.c_int)


class Region(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("length", ctypes.c_uint64),
                ("access", ctypes.c_int32)]


class Request(ctypes.Structure):
    _fields_ = [("opcode", ctypes.c_int32), ("local", ctypes.c_void_p),
                ("remote", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class BatchStatus(ctypes.Structure):
    _fields_ = [("pending", ctypes.c_uint64), ("succeeded", ctypes.c_uint64),
                ("failed", ctypes.c_uint64), ("first_error", ctypes.c_int32),
                ("first_failed", ctypes.c_uint64)]


class KvLayout(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_uint32), ("combined_kv", ctypes.c_int32),
                ("page_tokens", ctypes.c_uint32), ("bytes_per_token", ctypes.c_uint64),
                ("pages", ctypes.c_uint32)]


class KvSenderOptions(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_int64), ("checksums", ctypes.c_int32),
                ("tell_timeout_ms", ctypes.c_int64)]


class XferTelemetry(ctypes.Structure):
    _fields_ = [("start_us", ctypes.c_int64), ("post_us", ctypes.c_int64),
                ("transfer_us", ctypes.c_int64), ("bytes", ctypes.c_uint64),
                ("descriptors", ctypes.c_uint64)]


P = ctypes.c_void_p
I = ctypes.c_int
S = ctypes.c_char_p
SZ = ctypes.c_size_t
I64 = ctypes.c_int64
U32 = ctypes.c_uint32

_PROTOTYPES = {
    "kvferry_api_version": (U32, []),
    "kvferry_version": (S, []),
    "kvferry_last_error": (S, []),
    "kvferry_status_name": (S, [I]),
    "kvferry_free": (None, [P]),
    "kvferry_options_new": (P, []),
    "kvferry_options_free": (None, [P]),
    "kvferry_options_set": (I, [P, S, S]),
    "kvferry_engine_create": (I, [P, ctypes.POINTER(P)]),
    "kvferry_engine_destroy": (None, [P]),
    "kvferry_engine_address": (S, [P]),
    "kvferry_engine_id": (c_u64, [P]),
    "kvferry_engine_detection": (S, [P, S]),
    "kvferry_engine_metrics_address": (S, [P]),
    "kvferry_register_memory": (I, [P, P, c_u64, I, S]),
    "kvferry_unregister_memory": (I, [P, P]),
    "kvferry_open_segment": (I, [P, S, c_u64_p]),
    "kvferry_close_segment": (I, [P, c_u64]),
    "kvferry_segment_regions": (I, [P, c_u64, ctypes.POINTER(Region), SZ, c_size_p]),
    "kvferry_segment_engine_id": (I, [P, c_u64, c_u64_p]),
    "kvferry_submit": (I, [P, c_u64, ctypes.POINTER(Request), SZ, c_u64, c_u64_p]),
    "kvferry_submit_columns": (I, [P, c_u64, I, P, P, P, SZ, c_u64, c_u64_p]),
    "kvferry_poll": (I, [P, c_u64, ctypes.POINTER(BatchStatus)]),
    "kvferry_wait": (I, [P, c_u64, I64, ctypes.POINTER(BatchStatus)]),
    "kvferry_release": (I, [P, c_u64]),
    "kvferry_transfer_sync": (I, [P, S, I, P, P, P, SZ, I64]),
    "kvferry_finish": (I, [P, c_u64, I64, ctypes.POINTER(BatchStatus)]),
    "kvferry_submit_on_stream": (I, [P, c_u64, I, P, P, P, SZ, P, I, I64, I, c_u64_p]),
    "kvferry_wait_on_stream": (I, [P, c_u64, I64, ctypes.POINTER(BatchStatus)]),
    "kvferry_notify": (I, [P, c_u64, P, SZ, c_u64]),
    "kvferry_notify_after": (I, [P, c_u64, P, SZ, I64]),
    "kvferry_next_notification": (I, [P, I64, c_u64_p, c_char_pp, c_size_p]),
    "kvferry_publish_metadata": (I, [P, S, P, SZ]),
    "kvferry_fetch_metadata": (I, [P, c_u64, S, c_char_pp, c_size_p]),
    "kvferry_probe": (I, [P, S, I64, c_u64_p]),
    "kvferry_fence_peer": (None, [P, c_u64]),
    "kvferry_peer_fenced": (I, [P, c_u64]),
    "kvferry_metrics_text": (I, [P, c_char_pp, c_size_p]),
    "kvferry_metrics_json": (I, [P, c_char_pp, c_size_p]),
    "kvferry_local_topology": (I, [S, c_char_pp, c_size_p]),
    "kvferry_cuda_available": (I, []),
    "kvferry_set_log_level": (I, [I]),
    "kvferry_log": (None, [I, S]),
    "kvferry_kv_pool_allocate": (I, [ctypes.POINTER(KvLayout), ctypes.POINTER(P)]),
    "kvferry_kv_pool_wrap": (I, [ctypes.POINTER(KvLayout), ctypes.POINTER(P), SZ,
                                 ctypes.POINTER(P)]),
    "kvferry_kv_pool_free": (None, [P]),
    "kvferry_kv_pool_buffer": (P, [P, U32]),
    "kvferry_kv_sender_create": (I, [P, P, ctypes.POINTER(KvSenderOptions), ctypes.POINTER(P)]),
    "kvferry_kv_sender_destroy": (None, [P]),
    "kvferry_kv_sender_begin": (I, [P, S, S, c_u32_p, c_u32_p, SZ, c_u64_p]),
    "kvferry_kv_sender_send_layer": (I, [P, c_u64, U32]),
    "kvferry_kv_sender_send_all": (I, [P, c_u64]),
    "kvferry_kv_sender_finish": (I, [P, c_u64, P, SZ]),
    "kvferry_kv_sender_cancel": (I, [P, c_u64, S]),
    "kvferry_kv_sender_send": (I, [P, S, S, c_u32_p, c_u32_p, SZ, P, SZ]),
    "kvferry_kv_receiver_create": (I, [P, P, I64, ctypes.POINTER(P)]),
    "kvferry_kv_receiver_destroy": (None, [P]),
    "kvferry_kv_receiver_expect": (I, [P, S, S, c_u64]),
    "kvferry_kv_receiver_poll": (I, [P, S, c_int_p, c_char_pp, c_size_p]),
    "kvferry_kv_receiver_wait": (I, [P, S, I64, c_int_p, c_char_pp, c_size_p]),
    "kvferry_kv_receiver_forget": (None, [P, S]),
    "kvferry_kv_receiver_checksum_failures": (c_u64, [P]),
    "kvferry_prep_local": (I, [P, P, P, SZ, c_u64_p]),
    "kvferry_prep_remote": (I, [P, c_u64, P, P, SZ, c_u64_p]),
    "kvferry_release_list": (I, [P, c_u64]),
    "kvferry_list_size": (I, [P, c_u64, c_u64_p, c_u64_p]),
    "kvferry_make_xfer": (I, [P, I, c_u64, P, c_u64, P, SZ, P, SZ, I, c_u64_p]),
    "kvferry_post_xfer": (I, [P, c_u64, P, SZ, ctypes.POINTER(ctypes.c_int32)]),
    "kvferry_xfer_state": (I, [P, c_u64, ctypes.POINTER(ctypes.c_int32)]),
    "kvferry_xfer_telemetry_get": (I, [P, c_u64, ctypes.POINTER(XferTelemetry)]),
    "kvferry_release_xfer": (I, [P, c_u64]),
}

for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes

API_VERSION = 2
if lib.kvferry_api_version() < API_VERSION:
    raise ImportError(f"kvferry: libkvferry.so has C API version {lib.kvferry_api_version()}, "
                      f"this package needs {API_VERSION} or later")

OK = 0
DEADLINE_EXCEEDED = 4
LOG_WARNING = 2


def text(value):
    """str -> UTF-8 bytes for a C string (None stays None)."""
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


def blob(value):
    """str or bytes -> bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return str(value).encode()


def last_error():
    return lib.kvferry_last_error().decode(errors="replace")


def error(rc):
    return Error(last_error(), lib.kvferry_status_name(rc).decode())


def check(rc):
    if rc != OK:
        raise error(rc)


def take_bytes(pointer, length):
    """Bytes the library allocated (char** out), freed here."""
    if not pointer.value:
        return b""
    try:
        return ctypes.string_at(pointer.value, length.value)
    finally:
        lib.kvferry_free(pointer)


def u64_array(values):
    """A C array of uint64 (array.array: built at C speed from a list, and
    kept alive by the caller for the call): (array, its address, count)."""
    a = array.array("Q", values)
    return a, a.buffer_info()[0] if a else None, len(a)


def u32_array(values):
    a = array.array("I", values)
    assert a.itemsize == 4
    address = a.buffer_info()[0] if a else None
    return a, ctypes.cast(address, c_u32_p) if address else None, len(a)


def log(level, message):
    lib.kvferry_log(level, text(message))
