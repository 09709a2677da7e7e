"""NIXL's Python surface (`nixl._api`, `nixl._bindings`) on kvferry.

`python3 -m kvferry_compat install --nixl` writes a small `nixl` package
that re-exports what is here, so vLLM's NixlConnector, Dynamo and
TensorRT-LLM's Python agent run on kvferry unmodified (docs/nixl.md).

Each agent is one kvferry engine. Its metadata (get_agent_metadata) is
kvferry's own bytes: the agent's name, the engine's "host:port" and engine
id; add_remote_agent handshakes with that engine directly: no metadata
server, no listener thread. Every backend name the caller asks for ("UCX"
by default) is served by the one engine, over RDMA or TCP as it detected.

Prepared lists and transfers are the engine's (TransferEngine::prepared()):
checked once, stored as stride runs, posted again and again. A transfer's
notification goes to the peer once its data is in place, sent by the
engine whether or not this side polls. Calls are safe from any number of
threads at once, and the C calls run without the interpreter lock.

Errors raise the nixl*Error classes of `nixl._bindings` (subclasses of
Exception), as NIXL's do; transfer and check_xfer_state return only "DONE"
or "PROC".
"""
import array
import ctypes
import enum
import json
import logging
import os
import sys
import threading
import time

from . import _lib
from . import Engine as _Engine
from . import parse_access
from ._lib import lib
from ._mooncake import _default_access

log = logging.getLogger("kvferry.nixl")

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = ""
_MAGIC = b"KVFERRY-NIXL/1\n"
# A notification sent by an agent: the magic, the sender's name's length (2
# bytes, big-endian), the name, the message.
_NOTE = b"\x00nixl"
_BACKENDS = ("UCX", "KVFERRY")  # served by the engine; others are skipped


# ------------------------------------------------------------- exceptions

class nixlNotPostedError(Exception):
    pass


class nixlInvalidParamError(Exception):
    pass


class nixlBackendError(Exception):
    pass


class nixlNotFoundError(Exception):
    pass


class nixlMismatchError(Exception):
    pass


class nixlNotAllowedError(Exception):
    pass


class nixlRepostActiveError(Exception):
    pass


class nixlUnknownError(Exception):
    pass


class nixlNotSupportedError(Exception):
    pass


class nixlRemoteDisconnectError(Exception):
    pass


class nixlCancelledError(Exception):
    pass


class nixlNoTelemetryError(Exception):
    pass


_BY_NAME = {
    "NIXL_ERR_NOT_POSTED": nixlNotPostedError,
    "NIXL_ERR_INVALID_PARAM": nixlInvalidParamError,
    "NIXL_ERR_BACKEND": nixlBackendError,
    "NIXL_ERR_NOT_FOUND": nixlNotFoundError,
    "NIXL_ERR_MISMATCH": nixlMismatchError,
    "NIXL_ERR_NOT_ALLOWED": nixlNotAllowedError,
    "NIXL_ERR_REPOST_ACTIVE": nixlRepostActiveError,
    "NIXL_ERR_UNKNOWN": nixlUnknownError,
    "NIXL_ERR_NOT_SUPPORTED": nixlNotSupportedError,
    "NIXL_ERR_REMOTE_DISCONNECT": nixlRemoteDisconnectError,
    "NIXL_ERR_CANCELED": nixlCancelledError,
    "NIXL_ERR_NO_TELEMETRY": nixlNoTelemetryError,
}
# kvferry's codes (c/kvferry.h) as NIXL's.
_FROM_KVFERRY = {
    "INVALID_ARGUMENT": "NIXL_ERR_INVALID_PARAM",
    "NOT_FOUND": "NIXL_ERR_NOT_FOUND",
    "ALREADY_EXISTS": "NIXL_ERR_REPOST_ACTIVE",
    "UNAVAILABLE": "NIXL_ERR_REMOTE_DISCONNECT",
    "DEADLINE_EXCEEDED": "NIXL_ERR_REMOTE_DISCONNECT",
    "CANCELLED": "NIXL_ERR_CANCELED",
    "UNIMPLEMENTED": "NIXL_ERR_NOT_SUPPORTED",
}


def _raise(status_name, detail=""):
    cls = _BY_NAME[status_name]
    raise cls(status_name + (f": {detail}" if detail else ""))


def _fail(rc):
    """Raises the NIXL error for a failed kvferry call."""
    name = lib.kvferry_status_name(rc).decode()
    _raise(_FROM_KVFERRY.get(name, "NIXL_ERR_BACKEND"), f"{name}: {_lib.last_error()}")


def _call(rc):
    if rc != _lib.OK:
        _fail(rc)


# ------------------------------------------------------------ small types

class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG,
                                                 nixl_mem_t.BLK_SEG, nixl_mem_t.OBJ_SEG,
                                                 nixl_mem_t.FILE_SEG)
NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE

_MEMS = {"DRAM": DRAM_SEG, "VRAM": VRAM_SEG, "FILE": FILE_SEG, "BLOCK": BLK_SEG, "OBJ": OBJ_SEG,
         "cpu": DRAM_SEG, "cuda": VRAM_SEG}
_OPS = {"READ": NIXL_READ, "WRITE": NIXL_WRITE}

nixl_backend_handle = int


class nixlXferTelemetry:
    """A finished transfer's figures: startTime (microseconds), postDuration
    and xferDuration (microseconds; the latter from the post to the state
    check that saw it end), totalBytes, descCount (after merging)."""

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount})")


# ------------------------------------------------------- descriptor lists

class _DList:
    """A descriptor list: parallel columns of addresses, lengths and device
    ids (array.array, so a million entries cost 24 MB, not a million tuples),
    plus meta for registration lists."""

    _width = 3

    def __init__(self, mem_type, descs=None, *_unused):
        self._type = _mem_enum(mem_type)
        self._addr = array.array("Q")
        self._len = array.array("Q")
        self._dev = array.array("Q")
        self._meta = []
        if isinstance(descs, int) or descs is None:
            return
        _fill(self, descs, self._width)

    def getType(self):
        return self._type

    def descCount(self):
        return len(self._addr)

    def __len__(self):
        return len(self._addr)

    def isEmpty(self):
        return len(self._addr) == 0

    def __getitem__(self, i):
        if i < 0:
            i += len(self._addr)
        if not 0 <= i < len(self._addr):
            raise IndexError("descriptor index out of range")
        t = (self._addr[i], self._len[i], self._dev[i])
        return t + (self._meta[i],) if self._width == 4 else t

    def __setitem__(self, i, desc):
        self._addr[i], self._len[i], self._dev[i] = desc[0], desc[1], desc[2]
        if self._width == 4:
            self._meta[i] = _meta(desc[3] if len(desc) > 3 else b"")

    def addDesc(self, desc):
        self._addr.append(desc[0])
        self._len.append(desc[1])
        self._dev.append(desc[2])
        if self._width == 4:
            self._meta.append(_meta(desc[3] if len(desc) > 3 else b""))

    append = addDesc

    def index(self, desc):
        for i in range(len(self._addr)):
            if (self._addr[i], self._len[i], self._dev[i]) == tuple(desc[:3]):
                return i
        raise ValueError("descriptor not in the list")

    def remDesc(self, i):
        del self._addr[i], self._len[i], self._dev[i]
        if self._width == 4:
            del self._meta[i]

    def clear(self):
        self.__init__(self._type)

    def print(self):
        print(repr(self))

    def __repr__(self):
        return f"{type(self).__name__}({self._type.name}, {len(self._addr)} descriptors)"

    def __getstate__(self):
        return (self._type, self._addr.tobytes(), self._len.tobytes(), self._dev.tobytes(),
                self._meta)

    def __setstate__(self, state):
        self._type = state[0]
        self._addr, self._len, self._dev = array.array("Q"), array.array("Q"), array.array("Q")
        self._addr.frombytes(state[1])
        self._len.frombytes(state[2])
        self._dev.frombytes(state[3])
        self._meta = state[4]


class nixlXferDList(_DList):
    _width = 3


class nixlRegDList(_DList):
    _width = 4

    def trim(self):
        return nixlXferDList(self._type, [self[i][:3] for i in range(len(self))])


class nixlRemoteDList(_DList):
    _width = 3


def _meta(m):
    return m if isinstance(m, bytes) else str(m).encode()


def _mem_enum(mem_type):
    if isinstance(mem_type, nixl_mem_t):
        return mem_type
    if isinstance(mem_type, int):
        return nixl_mem_t(mem_type)
    return _MEMS[mem_type]  # KeyError for an unknown name, as NIXL


def _fill(dlist, descs, width):
    """Fills `dlist` from a list of tuples or an Nx3 array of 8-byte
    integers (numpy or anything with the buffer protocol and a shape)."""
    if isinstance(descs, list):
        for d in descs:
            if not isinstance(d, tuple) or len(d) != width:
                raise TypeError(f"descriptors: a list of {width}-tuples")
            dlist.addDesc(d)
        return
    shape = getattr(descs, "shape", None)
    if shape is not None and len(shape) == 2 and shape[1] == 3:
        flat = _u64_view(descs, "descriptors")
        dlist._addr = array.array("Q", flat[0::3])
        dlist._len = array.array("Q", flat[1::3])
        dlist._dev = array.array("Q", flat[2::3])
        dlist._meta = [b""] * len(dlist._addr) if width == 4 else []
        return
    raise TypeError("descriptors: a list of tuples or an Nx3 uint64/int64 array")


def _u64_view(a, what):
    """An 8-byte integer array's items as unsigned 64-bit values, without
    copying them one by one."""
    try:
        m = memoryview(a)
    except TypeError:
        raise TypeError(f"{what}: an array with the buffer protocol") from None
    if not m.c_contiguous or m.itemsize != 8 or m.format not in ("q", "Q", "l", "L", "<q", "<Q",
                                                                   "<i8", "<u8"):
        raise TypeError(f"{what}: C-contiguous uint64 or int64 values")
    return m.cast("B").cast("Q")


def _indices(ids, what):
    """Index arrays: a list of ints, or a 1-D integer array (numpy int64 as
    vLLM passes them); as a C array of int64."""
    if isinstance(ids, array.array) and ids.typecode == "q":
        return ids
    try:
        m = memoryview(ids)
    except TypeError:
        m = None
    if m is not None and m.ndim == 1 and m.c_contiguous and m.itemsize == 8 and \
            m.format.lstrip("<=") in ("q", "l"):
        return array.array("q", m.cast("B").cast("q"))
    try:
        return array.array("q", [int(i) for i in ids])
    except (TypeError, ValueError, OverflowError):
        raise nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: {what}: integers") from None


def _tensor_descs(obj):
    """(addr, len, dev_id, is_cuda) for one torch-like tensor, or None."""
    needed = ("data_ptr", "numel", "element_size")
    if not all(hasattr(obj, n) for n in needed):
        return None
    if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
        raise ValueError("non-contiguous tensor")
    cuda = bool(getattr(obj, "is_cuda", False))
    dev = obj.get_device() if hasattr(obj, "get_device") else (
        getattr(getattr(obj, "device", None), "index", None) or 0)
    if dev is None or dev < 0:
        dev = 0
    return (obj.data_ptr(), obj.numel() * obj.element_size(), dev, cuda)


# ---------------------------------------------------------------- handles

class nixl_prepped_dlist_handle:
    def __init__(self, handle, agent, side, generation=0):
        self._handle = handle
        self._agent = agent
        self._side = side  # "" for the local side, else the remote agent's name
        self._generation = generation  # of the remote agent's metadata (0: local)
        self._released = False

    def release(self):
        if not self._released:
            self._released = True
            self._agent._release_list(self)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self):
        return f"nixl_prepped_dlist_handle({self._handle:#x}, released={self._released})"


class nixl_xfer_handle:
    def __init__(self, handle, agent, remote, generation):
        self._handle = handle
        self._agent = agent
        self._remote = remote
        self._generation = generation
        self._released = False

    def release(self):
        if not self._released:
            self._agent._release_xfer(self)
            self._released = True

    def __del__(self):
        try:
            self.release()
        except Exception:
            try:
                self._agent._leaked_xfer_handles.append(self._handle)
            except Exception:
                pass

    def __repr__(self):
        return f"nixl_xfer_handle({self._handle:#x}, released={self._released})"


# ------------------------------------------------------------------ agent

class nixl_agent_config:
    def __init__(self, enable_prog_thread=True, enable_listen_thread=False,
                 listen_port=DEFAULT_COMM_PORT, capture_telemetry=False, num_threads=0,
                 backends=["UCX"], sync_mode=None):  # noqa: B006 (NIXL's default)
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError("sync_mode must be a nixl_thread_sync_t")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


def _name(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode()
    return str(value)


class _Remote:
    def __init__(self, address, engine_id, segment, generation):
        self.address = address
        self.engine_id = engine_id
        self.segment = segment
        self.generation = generation


class nixl_agent:
    """One NIXL agent: one kvferry engine."""

    _generations = 0

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        name = _name(agent_name)
        if not name:
            raise ValueError("an agent needs a name")
        if nixl_conf is not None and instantiate_all:
            log.warning("nixl_agent: instantiate_all is ignored when a config is given")
        conf = nixl_conf if nixl_conf is not None else nixl_agent_config()
        self.name = name
        self.notifs = {}
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        self.plugin_list = list(_BACKENDS)
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)
        self._leaked_xfer_handles = []
        self._lock = threading.Lock()
        self._remotes = {}
        self._registered = {}  # addr -> (length, dev, mem_type)
        telemetry = os.environ.get("NIXL_TELEMETRY_ENABLE")
        if telemetry is not None:
            self._telemetry = telemetry.strip().lower() in ("1", "true", "yes", "on", "y")
        else:
            self._telemetry = bool(conf.capture_telemetry)
        # What peers may do with memory registered here: NIXL lets any agent
        # holding the metadata read and write; kvferry lets them write, and
        # read only with a handshake secret or KVFERRY_REMOTE_ACCESS=rw.
        self._access = parse_access(_default_access())
        port = conf.port if conf.enable_listen else 0
        self._engine = _Engine(host=os.environ.get("KVFERRY_HOST", ""), port=port,
                               transport=os.environ.get("KVFERRY_TRANSPORT", "auto"),
                               devices=tuple(d for d in os.environ.get("KVFERRY_DEVICES",
                                                                       "").split(",") if d),
                               secret=os.environ.get("KVFERRY_SECRET"))
        for b in conf.backends:
            self.create_backend(b)
        self.agent = self._engine  # NIXL's pybind agent; here the engine

    # ----------------------------------------------------------- backends

    def get_plugin_list(self):
        return list(self.plugin_list)

    def get_plugin_params(self, backend):
        if backend not in _BACKENDS:
            log.warning("%s is not a plugin", backend)
            return {}
        return {"num_threads": "0"}

    def get_plugin_mem_types(self, backend):
        if backend not in _BACKENDS:
            log.warning("%s is not a plugin", backend)
            return []
        return ["DRAM", "VRAM"]

    def get_backend_params(self, backend):
        if backend not in self.backends:
            log.warning("backend %s was not created", backend)
            return {}
        return dict(self.backend_options[backend])

    def get_backend_mem_types(self, backend):
        if backend not in self.backends:
            log.warning("backend %s was not created", backend)
            return []
        return ["DRAM", "VRAM"]

    def create_backend(self, backend, initParams={}):  # noqa: B006 (NIXL's default)
        if backend not in _BACKENDS:
            log.warning("backend %s is not available on kvferry; skipped", backend)
            return
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = ["DRAM", "VRAM"]
        self.backend_options[backend] = dict(initParams)

    # ------------------------------------------------------------- memory

    def get_reg_descs(self, descs, mem_type=None):
        return self._descs(descs, mem_type, nixlRegDList)

    def get_xfer_descs(self, descs, mem_type=None):
        return self._descs(descs, mem_type, nixlXferDList)

    def get_remote_descs(self, descs, mem_type=None):
        return self._descs(descs, mem_type, nixlRemoteDList)

    def _descs(self, descs, mem_type, cls):
        if isinstance(descs, _DList):
            if type(descs) is cls:
                return descs
            log.error("get_%s: a %s was given", cls.__name__, type(descs).__name__)
            return None
        try:
            tensors = descs if isinstance(descs, list) and descs and \
                _tensor_descs(descs[0]) is not None else (
                [descs] if _tensor_descs(descs) is not None else None)
            if tensors is not None:
                found = [_tensor_descs(t) for t in tensors]
                if len({(f[2], f[3]) for f in found}) > 1:
                    log.error("tensors on different devices")
                    return None
                kind = VRAM_SEG if found[0][3] else DRAM_SEG
                return cls(kind, [f[:3] + ((b"",) if cls._width == 4 else ())
                                  for f in found])
            if mem_type is None:
                log.error("descriptors without a mem_type")
                return None
            kind = _mem_enum(mem_type)
            return cls(kind, descs)
        except KeyError:
            raise
        except (TypeError, ValueError) as e:
            log.error("bad descriptors: %s", e)
            return None

    def register_memory(self, reg_list, mem_type=None, backends=[]):  # noqa: B006
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: bad descriptors")
        kind = descs.getType()
        if kind not in (DRAM_SEG, VRAM_SEG):
            _raise("NIXL_ERR_NOT_FOUND", f"no backend for {kind.name}")
        done = []
        try:
            for i in range(len(descs)):
                addr, length, dev = descs._addr[i], descs._len[i], descs._dev[i]
                location = f"cuda:{dev}" if kind == VRAM_SEG else ""
                rc = lib.kvferry_register_memory(self._engine._handle(), addr, length,
                                                 self._access, location.encode())
                if rc != _lib.OK:
                    _fail(rc)
                done.append(addr)
                with self._lock:
                    self._registered[addr] = (length, dev, kind)
        except Exception:
            for addr in done:  # all or none
                lib.kvferry_unregister_memory(self._engine._handle(), addr)
                with self._lock:
                    self._registered.pop(addr, None)
            raise
        return descs

    def deregister_memory(self, dereg_list, backends=[]):  # noqa: B006
        # The memory type is not needed to find a registration (tensors
        # bring their own).
        descs = self.get_reg_descs(dereg_list, "DRAM")
        if descs is None:
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: bad descriptors")
        missing = None
        for i in range(len(descs)):
            addr, length = descs._addr[i], descs._len[i]
            with self._lock:
                known = self._registered.get(addr)
            if known is None or known[0] != length:
                missing = (addr, length)
                continue
            rc = lib.kvferry_unregister_memory(self._engine._handle(), addr)
            if rc != _lib.OK:
                _fail(rc)
            with self._lock:
                self._registered.pop(addr, None)
        if missing is not None:
            _raise("NIXL_ERR_NOT_FOUND", f"[{missing[0]:#x}, +{missing[1]}) was not registered")

    def query_memory(self, reg_list, backend, mem_type=None):
        if backend not in self.backends:
            raise ValueError(f"backend {backend} was not created")
        descs = self.get_reg_descs(reg_list, mem_type)
        out = []
        with self._lock:
            for i in range(len(descs)):
                known = self._registered.get(descs._addr[i])
                out.append({"registered": "1"} if known else None)
        return out

    # ----------------------------------------------------------- metadata

    def get_agent_metadata(self):
        body = {"name": self.name, "address": self._engine.address,
                "engine_id": self._engine.engine_id}
        return _MAGIC + json.dumps(body, sort_keys=True).encode()

    def get_partial_agent_metadata(self, descs, inc_conn_info=False, backends=[]):  # noqa: B006
        # kvferry's metadata holds no regions (the peer's handshake gives
        # them), so a partial blob is the whole one.
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata):
        if not isinstance(metadata, (bytes, bytearray)) or not bytes(metadata).startswith(_MAGIC):
            _raise("NIXL_ERR_MISMATCH", "not a kvferry agent's metadata")
        try:
            body = json.loads(bytes(metadata)[len(_MAGIC):])
            name, address, engine_id = body["name"], body["address"], int(body["engine_id"])
        except (ValueError, KeyError, TypeError):
            _raise("NIXL_ERR_MISMATCH", "metadata does not parse")
        if name == self.name:
            _raise("NIXL_ERR_INVALID_PARAM", "that is this agent's own metadata")
        with self._lock:
            known = self._remotes.get(name)
        if known is not None:
            if (known.address, known.engine_id) != (address, engine_id):
                _raise("NIXL_ERR_NOT_ALLOWED",
                       f"agent {name} is known with other connection info; remove it first")
            return name.encode()
        segment = ctypes.c_uint64()
        e = self._engine._handle()
        rc = lib.kvferry_open_segment(e, address.encode(), ctypes.byref(segment))
        if rc != _lib.OK:
            _raise("NIXL_ERR_BACKEND", f"cannot reach {name} at {address}: {_lib.last_error()}")
        now_id = ctypes.c_uint64()
        _call(lib.kvferry_segment_engine_id(e, segment.value, ctypes.byref(now_id)))
        if now_id.value != engine_id:
            _raise("NIXL_ERR_MISMATCH",
                   f"{address} is another engine instance than the metadata's "
                   f"(agent {name} restarted): fetch its metadata again")
        with self._lock:
            nixl_agent._generations += 1
            self._remotes.setdefault(name, _Remote(address, engine_id, segment.value,
                                                   nixl_agent._generations))
        return name.encode()

    def remove_remote_agent(self, agent):
        with self._lock:
            self._remotes.pop(_name(agent), None)

    def check_remote_metadata(self, remote_name, descs=None):
        with self._lock:
            return _name(remote_name) in self._remotes

    def make_connection(self, remote_agent, backends=[]):  # noqa: B006
        self._remote(remote_agent)

    def _no_store(self, *args, **kwargs):
        _raise("NIXL_ERR_NOT_SUPPORTED",
               "kvferry has no metadata server or listener: pass get_agent_metadata() to "
               "add_remote_agent")

    send_local_metadata = _no_store
    send_partial_agent_metadata = _no_store
    fetch_remote_metadata = _no_store
    invalidate_local_metadata = _no_store

    def _remote(self, agent):
        with self._lock:
            r = self._remotes.get(_name(agent))
        if r is None:
            _raise("NIXL_ERR_NOT_FOUND", f"no metadata for agent {_name(agent)}")
        return r

    # ---------------------------------------------------- prepared lists

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=[]):  # noqa: B006
        side = _name(agent_name)
        if side == "NIXL_INIT_AGENT":
            side = ""
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            _raise("NIXL_ERR_NOT_FOUND", "bad descriptors")
        if descs.isEmpty():
            _raise("NIXL_ERR_NOT_FOUND", "an empty list")
        e = self._engine._handle()
        out = ctypes.c_uint64()
        addrs, lens = descs._addr, descs._len
        a, n = addrs.buffer_info()
        b = lens.buffer_info()[0]
        if side == self.name:
            _raise("NIXL_ERR_NOT_SUPPORTED", "transfers to this agent itself")
        if side == "":
            rc = lib.kvferry_prep_local(e, a, b, n, ctypes.byref(out))
            generation = 0
        else:
            r = self._remote(side)
            rc = lib.kvferry_prep_remote(e, r.segment, a, b, n, ctypes.byref(out))
            generation = r.generation
        _call(rc)
        return nixl_prepped_dlist_handle(out.value, self, side, generation)

    def release_dlist_handle(self, handle):
        handle.release()

    def _release_list(self, handle):
        lib.kvferry_release_list(self._engine._handle(), handle._handle)

    # ---------------------------------------------------------- transfers

    def _note(self, msg):
        if msg is None:
            return None
        msg = msg if isinstance(msg, bytes) else bytes(msg) if isinstance(
            msg, (bytearray, memoryview)) else str(msg).encode()
        name = self.name.encode()
        return _NOTE + len(name).to_bytes(2, "big") + name + msg

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                          remote_indices, notif_msg=b"", backends=[],  # noqa: B006
                          skip_desc_merge=False):
        op = self.nixl_ops[operation]
        if local_xfer_side._released or remote_xfer_side._released:
            _raise("NIXL_ERR_INVALID_PARAM", "a released list")
        if local_xfer_side._side != "" or remote_xfer_side._side == "":
            _raise("NIXL_ERR_INVALID_PARAM", "a local list and a remote one, in that order")
        r = self._remote(remote_xfer_side._side)
        if r.generation != remote_xfer_side._generation:
            _raise("NIXL_ERR_NOT_FOUND",
                   f"agent {remote_xfer_side._side} was removed since the list was prepared")
        li = _indices(local_indices, "local_indices")
        ri = _indices(remote_indices, "remote_indices")
        if len(li) != len(ri) or not li:
            _raise("NIXL_ERR_INVALID_PARAM", f"{len(li)} local and {len(ri)} remote indices")
        note = self._note(notif_msg) if notif_msg else None
        return self._make(op, local_xfer_side._handle, li, remote_xfer_side._handle, ri, note,
                          not skip_desc_merge, remote_xfer_side._side, r.generation)

    def _make(self, op, local, li, remote, ri, note, merge, side, generation):
        out = ctypes.c_uint64()
        n = len(li)
        rc = lib.kvferry_make_xfer(self._engine._handle(),
                                   _lib_op(op), local, li.buffer_info()[0], remote,
                                   ri.buffer_info()[0], n, note, len(note) if note else 0,
                                   1 if merge else 0, ctypes.byref(out))
        _call(rc)
        return nixl_xfer_handle(out.value, self, side, generation)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent,
                        notif_msg=b"", backends=[]):  # noqa: B006
        op = self.nixl_ops[operation]
        local = self.get_xfer_descs(local_descs) if not isinstance(local_descs, _DList) \
            else local_descs
        remote = self.get_xfer_descs(remote_descs) if not isinstance(remote_descs, _DList) \
            else remote_descs
        if local is None or remote is None:
            _raise("NIXL_ERR_INVALID_PARAM", "bad descriptors")
        if len(local) != len(remote) or any(local._len[i] != remote._len[i]
                                            for i in range(len(local))):
            _raise("NIXL_ERR_INVALID_PARAM", "the lists differ in count or lengths")
        lh = self.prep_xfer_dlist("", local)
        rh = self.prep_xfer_dlist(_name(remote_agent), remote)
        try:
            idx = array.array("q", range(len(local)))
            note = self._note(notif_msg) if notif_msg else None
            return self._make(op, lh._handle, idx, rh._handle, idx, note, False,
                              rh._side, rh._generation)
        finally:
            lh.release()
            rh.release()

    def _check_generation(self, handle):
        if handle._released:
            _raise("NIXL_ERR_INVALID_PARAM", "a released transfer handle")
        with self._lock:
            r = self._remotes.get(handle._remote)
        if r is None or r.generation != handle._generation:
            _raise("NIXL_ERR_NOT_FOUND", f"agent {handle._remote} was removed")

    def transfer(self, handle, notif_msg=b""):
        self._check_generation(handle)
        state = ctypes.c_int32()
        note = self._note(notif_msg) if notif_msg else None
        rc = lib.kvferry_post_xfer(self._engine._handle(), handle._handle, note,
                                   len(note) if note else 0, ctypes.byref(state))
        if rc == 7:  # PERMISSION_DENIED
            _raise("NIXL_ERR_BACKEND",
                   f"{_lib.last_error()}; a peer reads memory registered with kvferry only "
                   "when both agents have the same KVFERRY_SECRET, or where it was registered "
                   "with KVFERRY_REMOTE_ACCESS=rw (docs/nixl.md)")
        _call(rc)
        return "DONE" if state.value == 2 else "PROC"

    def check_xfer_state(self, handle):
        self._check_generation(handle)
        state = ctypes.c_int32()
        _call(lib.kvferry_xfer_state(self._engine._handle(), handle._handle, ctypes.byref(state)))
        if state.value == 0:
            _raise("NIXL_ERR_NOT_POSTED")
        return "DONE" if state.value == 2 else "PROC"

    def get_xfer_telemetry(self, handle):
        if not self._telemetry:
            _raise("NIXL_ERR_NO_TELEMETRY")
        t = _lib.XferTelemetry()
        rc = lib.kvferry_xfer_telemetry_get(self._engine._handle(), handle._handle,
                                            ctypes.byref(t))
        if rc == 9:  # FAILED_PRECONDITION: not finished yet (NIXL: undefined contents)
            return nixlXferTelemetry()
        _call(rc)
        start = int(time.monotonic() * 1e6) - (int(time.time() * 1e6) - t.start_us)
        return nixlXferTelemetry(start, t.post_us, t.transfer_us, t.bytes, t.descriptors)

    def estimate_xfer_cost(self, req_handle):
        _raise("NIXL_ERR_NOT_SUPPORTED")

    def query_xfer_backend(self, handle):
        return next(iter(self.backends), "UCX")

    def release_xfer_handle(self, handle):
        handle.release()

    def _release_xfer(self, handle):
        _call(lib.kvferry_release_xfer(self._engine._handle(), handle._handle))

    # ------------------------------------------------------ notifications

    def get_new_notifs(self, backends=[]):  # noqa: B006
        out = {}
        for sender, data in self._engine.notifications():
            if data.startswith(_NOTE) and len(data) >= len(_NOTE) + 2:
                n = int.from_bytes(data[len(_NOTE):len(_NOTE) + 2], "big")
                name = data[len(_NOTE) + 2:len(_NOTE) + 2 + n].decode(errors="replace")
                msg = data[len(_NOTE) + 2 + n:]
            else:  # not from an agent: keyed by the sending engine
                name, msg = f"kvferry:{sender:016x}", data
            out.setdefault(name, []).append(msg)
        return out

    def update_notifs(self, backends=[]):  # noqa: B006
        new = self.get_new_notifs(backends)
        with self._lock:
            for name, msgs in new.items():
                self.notifs.setdefault(name, []).extend(msgs)
            return {k: list(v) for k, v in self.notifs.items()}

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=[],  # noqa: B006
                               tag_is_prefix=True):
        self.update_notifs(backends)
        name = _name(remote_agent_name)
        tag = lookup_tag if isinstance(lookup_tag, bytes) else str(lookup_tag).encode()
        with self._lock:
            msgs = self.notifs.get(name, [])
            for i, m in enumerate(msgs):
                if (m.startswith(tag) if tag_is_prefix else tag in m):
                    del msgs[i]
                    return True
        return False

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        r = self._remote(remote_agent_name)
        note = self._note(notif_msg)
        _call(lib.kvferry_notify(self._engine._handle(), r.segment, note, len(note),
                                 r.engine_id))

    def prep_mem_view(self, dlist, *, backends=None):
        _raise("NIXL_ERR_NOT_SUPPORTED", "the device API is not available on kvferry")

    def release_mem_view(self, mvh):
        _raise("NIXL_ERR_NOT_SUPPORTED", "the device API is not available on kvferry")


def _lib_op(op):
    return 1 if op == NIXL_READ else 0


def _bindings_namespace():
    """What nixl._bindings exports."""
    names = ["nixlXferTelemetry", "nixlXferDList", "nixlRegDList", "nixlRemoteDList",
             "nixl_mem_t", "nixl_xfer_op_t", "nixl_status_t", "nixl_thread_sync_t",
             "DRAM_SEG", "VRAM_SEG", "BLK_SEG", "OBJ_SEG", "FILE_SEG", "NIXL_READ",
             "NIXL_WRITE", "NIXL_INIT_AGENT", "DEFAULT_COMM_PORT"] + list(
                 c.__name__ for c in _BY_NAME.values())
    mod = sys.modules[__name__]
    return {n: getattr(mod, n) for n in names}
