"""kvferry: a zero-configuration KV-cache transfer engine.

    from kvferry import TransferEngine   # instead of: from mooncake.engine import TransferEngine

TransferEngine mirrors the methods serving frameworks call on Mooncake's
Python engine, with the same arguments and return conventions (0 on
success, a negative number on failure; the reason is logged and kept for
get_last_error()). Peers are named "host:port"; no metadata server.

Engine, KvPool, KvSender and KvReceiver are the Pythonic API: failures raise
kvferry.Error (a RuntimeError) carrying the engine's message and status code.

The package is pure Python over libkvferry.so's C API (ctypes), so one wheel
serves every CPython from 3.9 and PyPy; the GIL is released while the engine
works.
"""
import ctypes
import json
import math

from kvferry import _lib
from kvferry._lib import Error, check, lib, text
from kvferry._mooncake import (  # noqa: F401
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    InnerTransferEngine,
    Read,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    Write,
)

__version__ = lib.kvferry_version().decode()

__all__ = [
    "Engine", "Error", "InnerTransferEngine", "KvPool", "KvReceiver", "KvSender",
    "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL",
    "SUPPORT_MUSA", "TransferEngine", "TransferNotify", "TransferOpcode",
]

_ACCESS = {"none": 0, "r": 1, "w": 2, "rw": 3}
_OPS = {"write": 0, "read": 1}


def parse_access(access):
    """'w' (peers may write), 'r', 'rw' or 'none' -> the C API's value."""
    if access not in _ACCESS:
        raise Error(f"access '{access}': \"w\" (peers may write), \"r\", \"rw\" or \"none\"",
                    "INVALID_ARGUMENT")
    return _ACCESS[access]


def _ms(seconds, name="timeout"):
    """Seconds -> whole milliseconds; a clear error for what is not a finite,
    non-negative number of seconds (nan would switch a timeout off)."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        raise Error(f"{name} {seconds!r}: a number of seconds", "INVALID_ARGUMENT") from None
    if not math.isfinite(s) or s < 0 or s > 1e9:
        raise Error(f"{name} {seconds!r}: a finite number of seconds from 0 to 1e9",
                    "INVALID_ARGUMENT")
    return int(round(s * 1000))


class _Handle:
    """Owns one C handle; frees it once (close(), or when collected)."""

    _free = None

    def __init__(self, handle):
        self._h = handle

    def close(self):
        h, self._h = self._h, None
        if h:
            type(self)._free(h)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def _handle(self):
        if not self._h:
            raise Error(f"{type(self).__name__} is closed", "FAILED_PRECONDITION")
        return self._h


class Engine(_Handle):
    """A kvferry engine; failures raise kvferry.Error."""

    _free = lib.kvferry_engine_destroy

    def __init__(self, host="", port=0, transport="auto", devices=(), metrics_port=-1,
                 metrics_host="127.0.0.1", secret=None):
        super().__init__(None)
        options = {"local_host": host, "port": port, "transport": transport,
                   "devices": ",".join(devices), "metrics_port": metrics_port,
                   "metrics_host": metrics_host}
        if secret is not None:
            options["secret"] = secret
        self._h = _create(options)

    @property
    def address(self):
        """"host:port", the name peers reach this engine by."""
        return lib.kvferry_engine_address(self._handle()).decode()

    @property
    def transport(self):
        return lib.kvferry_engine_detection(self._handle(), b"transport").decode()

    @property
    def engine_id(self):
        return lib.kvferry_engine_id(self._handle())

    @property
    def metrics_address(self):
        return lib.kvferry_engine_metrics_address(self._handle()).decode()

    def detection(self):
        """What creation decided and why (host, transport, devices, reasons)."""
        keys = ("host", "host_reason", "bind_host", "transport", "transport_reason", "devices")
        return {k: lib.kvferry_engine_detection(self._handle(), k.encode()).decode()
                for k in keys}

    def register_memory(self, addr, length, location="", access="w"):
        """Registers [addr, +length): host memory or GPU memory (a torch
        tensor's data_ptr(); told apart through the CUDA driver). location:
        "cpu:N" or "cuda:N", checked against the memory when the CUDA driver
        is present. access: what peers may do: "w" write (the default), "r"
        read, "rw", "none"."""
        check(lib.kvferry_register_memory(self._handle(), addr, length, parse_access(access),
                                          text(location)))

    def unregister_memory(self, addr):
        check(lib.kvferry_unregister_memory(self._handle(), addr))

    def transfer(self, peer, requests, timeout=30.0):
        """[(op, local, remote, length)] with op "write" or "read"; raises on
        any failed request (the message names it). One that does not finish
        within `timeout` raises DEADLINE_EXCEEDED, but only once nothing of
        it can land any more: bytes on their way cannot be called back, so
        it waits for the transfer to end (the engine's failure bounds end
        it; at most 60 s more)."""
        wait_ms = _ms(timeout)
        requests = list(requests)
        array = (_lib.Request * len(requests))()
        for i, (op, local, remote, length) in enumerate(requests):
            if op not in _OPS:
                raise Error(f"op '{op}': write or read", "INVALID_ARGUMENT")
            array[i].opcode, array[i].local = _OPS[op], local
            array[i].remote, array[i].length = remote, length
        e = self._handle()
        segment = ctypes.c_uint64()
        check(lib.kvferry_open_segment(e, text(peer), ctypes.byref(segment)))
        batch = ctypes.c_uint64()
        check(lib.kvferry_submit(e, segment, array, len(requests), 0, ctypes.byref(batch)))
        check(lib.kvferry_finish(e, batch, wait_ms, None))

    def notify(self, peer, message):
        """Sends `message` (bytes or str) to the engine at `peer`
        ("host:port"); returns once that engine has it."""
        if isinstance(message, str):
            message = message.encode()
        e = self._handle()
        segment = ctypes.c_uint64()
        check(lib.kvferry_open_segment(e, text(peer), ctypes.byref(segment)))
        check(lib.kvferry_notify(e, segment, message, len(message), 0))

    def notifications(self, timeout=0.0):
        """The notifications received and not yet taken, oldest first, as
        [(sender engine id, bytes)]; with timeout > 0, waits up to that many
        seconds for the first when there is none. A KvReceiver on this
        engine keeps its own words. Drain them: an engine holds at most
        65,536 (64 MiB) untaken, and refuses more to their senders."""
        e = self._handle()
        out = []
        sender, data, n = ctypes.c_uint64(), ctypes.c_void_p(), ctypes.c_size_t()
        wait = _ms(timeout) if timeout > 0 else 0
        while lib.kvferry_next_notification(e, wait, ctypes.byref(sender), ctypes.byref(data),
                                            ctypes.byref(n)) == _lib.OK:
            out.append((sender.value, _lib.take_bytes(data, n)))
            wait = 0
        return out

    def metrics(self):
        """{"peers": [...], "nics": [...], "prometheus": text}."""
        e = self._handle()
        out, n = ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.kvferry_metrics_json(e, ctypes.byref(out), ctypes.byref(n)))
        m = json.loads(_lib.take_bytes(out, n))
        check(lib.kvferry_metrics_text(e, ctypes.byref(out), ctypes.byref(n)))
        m["prometheus"] = _lib.take_bytes(out, n).decode()
        return m


def _create(options):
    """An engine handle from {option: value} (values as text)."""
    o = lib.kvferry_options_new()
    if not o:
        raise Error("out of memory", "RESOURCE_EXHAUSTED")
    try:
        for key, value in options.items():
            check(lib.kvferry_options_set(o, key.encode(), text(value)))
        e = ctypes.c_void_p()
        check(lib.kvferry_engine_create(o, ctypes.byref(e)))
        return e.value
    finally:
        lib.kvferry_options_free(o)


class KvPool(_Handle):
    """Where a KV pool's buffers are: one address per layer (and K/V), which
    the caller owns and keeps alive."""

    _free = lib.kvferry_kv_pool_free

    def __init__(self, layers, combined_kv, page_tokens, bytes_per_token, pages, buffers):
        super().__init__(None)
        layout = _lib.KvLayout(layers, 1 if combined_kv else 0, page_tokens, bytes_per_token,
                               pages)
        buffers = list(buffers)
        pointers = (ctypes.c_void_p * max(1, len(buffers)))(*buffers)
        out = ctypes.c_void_p()
        check(lib.kvferry_kv_pool_wrap(ctypes.byref(layout), pointers, len(buffers),
                                       ctypes.byref(out)))
        self._h = out.value


class KvSender(_Handle):
    """Sends a request's KV pages to a decode engine."""

    _free = lib.kvferry_kv_sender_destroy

    def __init__(self, engine, pool, checksums=False, timeout=30.0):
        super().__init__(None)
        self._engine = engine  # the engine outlives its sender
        options = _lib.KvSenderOptions(_ms(timeout), 1 if checksums else 0, 0)
        out = ctypes.c_void_p()
        check(lib.kvferry_kv_sender_create(engine._handle(), pool._handle(),
                                           ctypes.byref(options), ctypes.byref(out)))
        self._h = out.value

    def send(self, request_id, peer, src_pages, dst_pages, aux=""):
        src, src_p, n = _lib.u32_array(src_pages)
        dst, dst_p, m = _lib.u32_array(dst_pages)
        _same_length(n, m)
        data = _lib.blob(aux)
        check(lib.kvferry_kv_sender_send(self._handle(), text(request_id), text(peer), src_p,
                                         dst_p, n, data, len(data)))

    def begin(self, request_id, peer, src_pages, dst_pages):
        """Starts a request (checks pages and layouts; sends nothing); returns
        its handle for send_layer, send_all, finish and cancel."""
        src, src_p, n = _lib.u32_array(src_pages)
        dst, dst_p, m = _lib.u32_array(dst_pages)
        _same_length(n, m)
        handle = ctypes.c_uint64()
        check(lib.kvferry_kv_sender_begin(self._handle(), text(request_id), text(peer), src_p,
                                          dst_p, n, ctypes.byref(handle)))
        return handle.value

    def send_layer(self, handle, layer):
        """Sends one layer now (layer-wise mode)."""
        check(lib.kvferry_kv_sender_send_layer(self._handle(), handle, layer))

    def send_all(self, handle):
        """Sends every layer not sent yet."""
        check(lib.kvferry_kv_sender_send_all(self._handle(), handle))

    def finish(self, handle, aux=""):
        """Sends what remains, waits for every byte, then tells the decode the
        request is complete (or, on failure, that it failed)."""
        data = _lib.blob(aux)
        check(lib.kvferry_kv_sender_finish(self._handle(), handle, data, len(data)))

    def cancel(self, handle, reason=""):
        """Stops sending, waits for what is in flight, tells the decode the
        request failed."""
        check(lib.kvferry_kv_sender_cancel(self._handle(), handle, text(reason)))


def _same_length(n, m):
    if n != m:
        raise Error(f"{n} source pages but {m} destination pages", "INVALID_ARGUMENT")


class KvReceiver(_Handle):
    """Receives KV pages into a pool."""

    _free = lib.kvferry_kv_receiver_destroy

    def __init__(self, engine, pool, peer_timeout=4.0):
        super().__init__(None)
        self._engine = engine
        out = ctypes.c_void_p()
        ms = _ms(peer_timeout, "peer_timeout")
        if ms <= 0:
            raise Error(f"peer_timeout {peer_timeout!r}: at least a millisecond", "INVALID_ARGUMENT")
        check(lib.kvferry_kv_receiver_create(engine._handle(), pool._handle(), ms,
                                             ctypes.byref(out)))
        self._h = out.value

    def expect(self, request_id, prefill, engine_id=0):
        """Declares a request to come from the prefill at 'host:port': if that
        prefill dies, freezes or cannot be reached for peer_timeout first, the
        request fails (and the prefill is fenced: nothing of it lands
        afterwards)."""
        check(lib.kvferry_kv_receiver_expect(self._handle(), text(request_id), text(prefill),
                                             engine_id))

    def poll(self, request_id):
        """None while pending, the aux bytes once complete; raises
        kvferry.Error if it failed."""
        state, aux, n = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.kvferry_kv_receiver_poll(self._handle(), text(request_id), ctypes.byref(state),
                                           ctypes.byref(aux), ctypes.byref(n)))
        return None if state.value == 0 else _lib.take_bytes(aux, n)

    def wait(self, request_id, timeout=30.0):
        """The aux bytes once complete; raises kvferry.Error if it failed or
        is still pending after `timeout` seconds (DEADLINE_EXCEEDED)."""
        state, aux, n = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        check(lib.kvferry_kv_receiver_wait(self._handle(), text(request_id), _ms(timeout),
                                           ctypes.byref(state), ctypes.byref(aux),
                                           ctypes.byref(n)))
        return _lib.take_bytes(aux, n)

    def forget(self, request_id):
        """Forgets a finished request, so its id can be used again."""
        lib.kvferry_kv_receiver_forget(self._handle(), text(request_id))

    @property
    def checksum_failures(self):
        return lib.kvferry_kv_receiver_checksum_failures(self._handle())
