"""kvferry.TransferEngine: every method of Mooncake's Python TransferEngine
(mooncake.engine), with its argument names, defaults and return
conventions: 0 on success and a negative number on failure (the reason is
logged and kept for get_last_error(), which a later success clears), batch
ids from the async calls, Mooncake's fallbacks at initialize (a device that
does not exist becomes automatic discovery; "rdma" means RDMA where both
ends have it and TCP otherwise; each with one warning, errors under
KVFERRY_REQUIRE_RDMA=1 or MC_FORCE_HCA) and the MC_* environment
(docs/migrating-from-mooncake.md). The native API keeps its strict errors:
all of this lives here.
"""
import ctypes
import mmap
import os
import socket
import threading
import time

from kvferry import _lib
from kvferry._lib import lib, text

# Mooncake's capability flags. kvferry has no EFA, HIP, MNNVL, intra-node
# NVLink or MUSA transport; the stream-ordered *_on_cuda calls work where a
# CUDA driver loads.
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_MUSA = False
SUPPORT_CUDA = bool(lib.kvferry_cuda_available())

_U64x3 = ctypes.c_uint64 * 3

# A notification sent with transfer_sync(..., notify=TransferNotify(name,
# msg)) travels as this tag, the name, a NUL and the message.
_NOTIFY_TAG = b"\x01mooncake-notify\x01"

_KNOWN_MC = {
    "MC_FORCE_TCP", "MC_FORCE_HCA", "MC_GID_INDEX", "MC_TRANSFER_TIMEOUT", "MC_SLICE_SIZE",
    "MC_NUM_QP_PER_EP", "MC_HANDSHAKE_CONNECT_TIMEOUT", "MC_TCP_BIND_ADDRESS", "MC_MIN_RPC_PORT",
    "MC_MAX_RPC_PORT", "MC_MIN_PRC_PORT", "MC_MAX_PRC_PORT", "MC_LOG_LEVEL", "MC_USE_IPV6",
    "MC_LEGACY_RPC_PORT_BINDING", "MC_TE_METRIC", "MC_METADATA_SERVER",
}


class TransferOpcode(int):
    """Mooncake's TransferOpcode: Read (0) and Write (1)."""

    _names = {0: "Read", 1: "Write"}

    def __repr__(self):
        return f"<TransferOpcode.{self._names.get(int(self), int(self))}: {int(self)}>"

    @property
    def name(self):
        return self._names[int(self)]

    @property
    def value(self):
        return int(self)


TransferOpcode.Read = TransferOpcode(0)
TransferOpcode.Write = TransferOpcode(1)
Read = TransferOpcode.Read  # exported to the module, as Mooncake's enum values are
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent with transfer_sync: a name and a message."""

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class InnerTransferEngine:
    """The kvferry engine behind a TransferEngine (get_engine())."""

    def __init__(self, owner):
        self._owner = owner

    @property
    def address(self):
        return self._owner.get_local_address()

    @property
    def transport(self):
        return self._owner._detect("transport")

    @property
    def transport_reason(self):
        return self._owner._detect("transport_reason")


class _Failure(Exception):
    """A Mooncake call's failure: becomes its negative return value."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


def _env_on(name):
    v = os.environ.get(name)
    return v is not None and v.lower() not in ("", "0", "false")


def _env_int(name, lo, hi):
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        n = int(v.strip(), 10)
    except ValueError:
        n = None
    if n is None or n < lo or n > hi or v.strip() != v:
        raise _Failure(f"{name}='{v}': an integer from {lo} to {hi} is expected",
                       "INVALID_ARGUMENT")
    return n


def _is_ipv6(host):
    try:
        socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
        return True
    except (OSError, ValueError):
        return False


def split_host_port(name):
    """(host, port) of "host", "host:port", "[v6]:port", "[v6]", a bare IPv6
    address, or an IPv6 address and port without brackets ("fe80::1:15001",
    split at the last colon as Mooncake does). Port 0: none given."""
    if _is_ipv6(name):
        return name, 0
    if len(name) > 2 and name[0] == "[" and name[-1] == "]":
        return name[1:-1], 0
    if ":" not in name:
        return name, 0
    if name.startswith("["):
        end = name.find("]")
        if end < 0:
            raise _Failure(f"bad address '{name}': an IPv6 address in brackets needs its ']'",
                           "INVALID_ARGUMENT")
        host, rest = name[1:end], name[end + 1:]
        if not rest.startswith(":"):
            raise _Failure(f"bad address '{name}': ':port' expected after ']'", "INVALID_ARGUMENT")
        port = rest[1:]
    else:
        host, _, port = name.rpartition(":")
        if ":" in host and not _is_ipv6(host):
            raise _Failure(f"bad address '{name}': more than one ':' (host:port, or [v6]:port "
                           "with the IPv6 address in brackets)", "INVALID_ARGUMENT")
    if not port.isdigit() or int(port) > 65535:
        raise _Failure(f"bad address '{name}': port '{port}' is not a number from 0 to 65535",
                       "INVALID_ARGUMENT")
    return host, int(port)


def peer_name(target):
    """A target as Mooncake callers write it -> the "host:port" kvferry's
    handshake uses (IPv6 in brackets); anything else unchanged, to fail
    where it is used."""
    try:
        host, port = split_host_port(target)
    except _Failure:
        return target
    if port == 0:
        return target
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def transfer_timeout():
    """MC_TRANSFER_TIMEOUT as Mooncake reads it: seconds, at least 5, default 30."""
    seconds = _env_int("MC_TRANSFER_TIMEOUT", 0, 86400)
    return max(5, 30 if seconds is None else seconds)


def mooncake_options(options):
    """Applies the MC_* variables to `options` (a dict of engine options)."""
    v = _env_int("MC_SLICE_SIZE", 4096, 1 << 30)
    if v is not None:
        options["slice_bytes"] = v
    v = _env_int("MC_NUM_QP_PER_EP", 1, 64)
    if v is not None:
        options["links_per_peer"] = v
    v = _env_int("MC_HANDSHAKE_CONNECT_TIMEOUT", 1, 3599)
    if v is not None:
        options["handshake_timeout_ms"] = v * 1000
    lo, hi = 15000, 17000  # the engine's defaults
    for name in ("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"):
        v = _env_int(name, 1, 65535)
        if v is not None:
            lo = v
            break
    for name in ("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"):
        v = _env_int(name, 1, 65535)
        if v is not None:
            hi = v
            break
    if lo > hi:
        raise _Failure(f"MC_MIN_RPC_PORT {lo} is above MC_MAX_RPC_PORT {hi}", "INVALID_ARGUMENT")
    options["first_port"], options["last_port"] = lo, hi
    bind = os.environ.get("MC_TCP_BIND_ADDRESS")
    if bind:
        options["bind_host"] = bind
    if _env_on("MC_TE_METRIC"):
        options["metrics_port"] = 0  # Prometheus on a free loopback port
    level = os.environ.get("MC_LOG_LEVEL")
    if level is not None:
        levels = {"trace": 0, "debug": 0, "info": 1, "warning": 2, "warn": 2, "error": 3}
        if level.lower() not in levels:
            raise _Failure(f"MC_LOG_LEVEL='{level}': TRACE, INFO, WARNING or ERROR is expected",
                           "INVALID_ARGUMENT")
        lib.kvferry_set_log_level(levels[level.lower()])
    ignored = sorted(k for k in os.environ if k.startswith("MC_") and k not in _KNOWN_MC)
    if ignored:
        _warn("kvferry: ignoring Mooncake tuning variable(s) " + ", ".join(ignored) +
              ": kvferry sizes queues, CQs and workers itself (docs/migrating-from-mooncake.md)")


def _warn(message):
    _lib.log(_lib.LOG_WARNING, message)


def _default_access():
    """What peers may do with memory registered here: KVFERRY_REMOTE_ACCESS
    if set; else, with a handshake secret (only authenticated peers get
    keys), read and write as in Mooncake; else write only."""
    named = os.environ.get("KVFERRY_REMOTE_ACCESS")
    if named:
        return named
    return "rw" if os.environ.get("KVFERRY_SECRET") else "w"


class TransferEngine:
    """Mooncake's Python TransferEngine (mooncake.engine), P2PHANDSHAKE mode:
    the same methods, arguments and return values."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._e = None
        self._address = ""
        self._timeout = 30.0
        self._last_error = ""
        self._mu = threading.Lock()
        self._batches = {}   # async batches not yet collected: id -> (start, timeout s)
        self._managed = {}   # allocate_managed_buffer: address -> mmap
        self._local = {}     # address -> length registered here, in registration order
        self._peers = {}     # target -> the handshake's peer name (bounded)

    def __del__(self):
        e, self._e = getattr(self, "_e", None), None
        if e is None:
            return
        try:
            status = _lib.BatchStatus()
            for batch in list(self._batches):  # give them a moment, then let go
                if lib.kvferry_wait(e, batch, 1000, ctypes.byref(status)) != _lib.DEADLINE_EXCEEDED:
                    lib.kvferry_release(e, batch)
            kept = []
            for addr, region in self._managed.items():
                # Unmapped only once the engine forgot it (a buffer in use
                # stays mapped rather than have a transfer touch freed memory).
                if lib.kvferry_unregister_memory(e, addr) == _lib.OK:
                    region.close()
                else:
                    kept.append(region)
            lib.kvferry_engine_destroy(e)
            for region in kept:
                region.close()
        except Exception:  # interpreter shutdown
            pass

    # ----------------------------------------------------------- plumbing

    def _begin(self):
        self._last_error = ""

    def _ready(self):
        self._begin()
        if self._e is None:
            raise _Failure("call initialize() first", "FAILED_PRECONDITION")
        return self._e

    def _fail(self, failure, value=-1):
        self._last_error = f"{failure.code}: {failure}" if failure.code else str(failure)
        _warn("kvferry: " + self._last_error)
        return value

    def _call(self, rc):
        """A C call's code -> raises _Failure unless OK."""
        if rc != _lib.OK:
            raise _Failure(_lib.last_error(), lib.kvferry_status_name(rc).decode())

    def _detect(self, key):
        return lib.kvferry_engine_detection(self._e, key.encode()).decode() if self._e else ""

    def _segment(self, target):
        segment = ctypes.c_uint64()
        self._call(lib.kvferry_open_segment(self._e, self._peer(target), ctypes.byref(segment)))
        return segment

    def _columns(self, buffers, peers, lengths):
        if not isinstance(buffers, list):
            buffers = list(buffers)
        if not isinstance(peers, list):
            peers = list(peers)
        if not isinstance(lengths, list):
            lengths = list(lengths)
        if not (len(buffers) == len(peers) == len(lengths)):
            raise _Failure("buffers, peer addresses and lengths differ in count",
                           "INVALID_ARGUMENT")
        if not buffers:
            raise _Failure("no buffers to transfer", "INVALID_ARGUMENT")
        try:
            cols = [_lib.u64_array(v) for v in (buffers, peers, lengths)]
        except (OverflowError, TypeError) as e:
            raise _Failure(f"addresses and lengths must be integers from 0 to 2**64-1 ({e})",
                           "INVALID_ARGUMENT")
        return cols, sum(lengths)

    def _timeout_for(self, nbytes):
        # Mooncake's: MC_TRANSFER_TIMEOUT plus one second per GiB.
        return self._timeout + nbytes / 1e9

    # ------------------------------------------------------------- set-up

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name,
                       metadata_type):
        self._begin()
        try:
            if self._e is not None:
                raise _Failure("already initialized", "FAILED_PRECONDITION")
            if metadata_server and metadata_server != "P2PHANDSHAKE":
                kind = f" ({metadata_type})" if metadata_type else ""
                raise _Failure(f"metadata server '{metadata_server}'{kind}: kvferry needs none; "
                               "pass \"P2PHANDSHAKE\" (peers are named host:port)",
                               "INVALID_ARGUMENT")
            host, port = split_host_port(local_hostname)
            options = {"local_host": "127.0.0.1" if host == "localhost" else host, "port": port}
            mooncake_options(options)
            timeout = transfer_timeout()
            if protocol not in ("rdma", "tcp", ""):
                raise _Failure(f"protocol '{protocol}': kvferry speaks \"rdma\" and \"tcp\" "
                               "(empty: either)", "INVALID_ARGUMENT")
            strict = _env_on("KVFERRY_REQUIRE_RDMA") or _env_on("MC_FORCE_HCA")
            transport = protocol or "auto"
            if _env_on("MC_FORCE_TCP"):
                if strict:
                    raise _Failure("MC_FORCE_TCP contradicts KVFERRY_REQUIRE_RDMA / MC_FORCE_HCA",
                                   "INVALID_ARGUMENT")
                if transport != "tcp":
                    _warn("kvferry: MC_FORCE_TCP is set: using TCP")
                transport = "tcp"
            devices = [d.strip() for d in device_name.split(",") if d.strip()]
            if transport == "tcp":
                devices = []
            self._e = self._create_with_fallbacks(options, transport, devices, strict)
            self._address = lib.kvferry_engine_address(self._e).decode()
            self._timeout = float(timeout)
            return 0
        except _Failure as f:
            return self._fail(f)

    def _create_with_fallbacks(self, options, transport, devices, strict):
        """Mooncake's fallbacks: a device that does not exist becomes
        discovery; "rdma" is RDMA where both ends have it, else TCP (an
        automatic engine keeps TCP beside RDMA for peers without it)."""
        from kvferry import _create  # the package's engine constructor
        wanted = transport
        if transport == "rdma" and not strict:
            transport = "auto"

        def create(devs):
            try:
                return _create(dict(options, transport=transport, devices=",".join(devs)))
            except _lib.Error as e:
                raise _Failure(str(e), e.code)

        try:
            e = create(devices)
        except _Failure as f:
            if strict or transport == "tcp" or not devices:
                raise
            _warn(f"kvferry: device(s) '{','.join(devices)}': {f}; using the RDMA devices "
                  "discovery finds instead (Mooncake's fallback; KVFERRY_REQUIRE_RDMA=1 makes "
                  "this an error)")
            e = create([])
        if wanted == "rdma" and transport == "auto":
            chosen = lib.kvferry_engine_detection(e, b"transport").decode()
            if chosen != "rdma":
                reason = lib.kvferry_engine_detection(e, b"transport_reason").decode()
                _warn(f"kvferry: protocol rdma: {reason}; using TCP instead (Mooncake's "
                      "fallback; KVFERRY_REQUIRE_RDMA=1 makes this an error)")
        return e

    def get_rpc_port(self):
        try:
            self._ready()
        except _Failure as f:
            return self._fail(f)
        return int(self._address.rsplit(":", 1)[1])

    def get_local_address(self):
        return self._address

    def get_last_error(self):
        """kvferry's: why the last call failed; empty after a call that succeeded."""
        return self._last_error

    def get_engine(self):
        self._begin()
        if self._e is None:
            self._fail(_Failure("call initialize() first", "FAILED_PRECONDITION"))
            return None
        return InnerTransferEngine(self)

    def get_engine_ptr(self):
        self._begin()
        return self._e or 0

    # ------------------------------------------------------------- memory

    def allocate_managed_buffer(self, length):
        """Page-aligned memory registered with the engine; 0 on failure."""
        try:
            self._ready()
            if length <= 0:
                raise _Failure("allocate_managed_buffer: length 0", "INVALID_ARGUMENT")
            try:
                region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, OverflowError, ValueError) as e:
                raise _Failure(f"allocate_managed_buffer: {length} bytes: {e}",
                               "RESOURCE_EXHAUSTED")
            addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
        except _Failure as f:
            return self._fail(f, 0)
        if self.register_memory(addr, length) != 0:
            region.close()
            return 0
        with self._mu:
            self._managed[addr] = region
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        self._begin()
        with self._mu:
            region = self._managed.pop(buffer_addr, None)
        if region is None:
            return self._fail(_Failure(f"free_managed_buffer: {buffer_addr} is not from "
                                       "allocate_managed_buffer", "NOT_FOUND"))
        if length != len(region):
            _warn(f"kvferry: free_managed_buffer: length {length} differs from the "
                  f"allocation's {len(region)}; freeing the allocation")
        if self.unregister_memory(buffer_addr) != 0:
            with self._mu:
                self._managed[buffer_addr] = region  # still registered (in use): kept
            return -1
        region.close()
        return 0

    def register_memory(self, buffer_addr, capacity, location="*", access=""):
        """Registers [buffer_addr, +capacity). access (kvferry's): "w" (peers
        may write into it), "r", "rw" or "none"; default KVFERRY_REMOTE_ACCESS,
        else "rw" with a handshake secret (KVFERRY_SECRET) and "w" without.
        0 or -1."""
        from kvferry import parse_access
        try:
            e = self._ready()
            try:
                a = parse_access(access or _default_access())
            except _lib.Error as err:
                raise _Failure(str(err), err.code)
            self._call(lib.kvferry_register_memory(e, buffer_addr, capacity, a,
                                                   text("" if location == "*" else location)))
            with self._mu:
                self._local[buffer_addr] = capacity
            return 0
        except _Failure as f:
            return self._fail(f)

    def unregister_memory(self, buffer_addr):
        try:
            self._call(lib.kvferry_unregister_memory(self._ready(), buffer_addr))
            with self._mu:
                self._local.pop(buffer_addr, None)
            return 0
        except _Failure as f:
            return self._fail(f)

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        try:
            self._ready()
        except _Failure as f:
            return self._fail(f)
        buffer_addresses, capacities = list(buffer_addresses), list(capacities)
        if len(buffer_addresses) != len(capacities):
            return self._fail(_Failure("addresses and capacities differ in count",
                                       "INVALID_ARGUMENT"))
        for i, (addr, capacity) in enumerate(zip(buffer_addresses, capacities)):
            if self.register_memory(addr, capacity, location) != 0:
                error = self._last_error
                for done in buffer_addresses[:i]:  # none of them stays registered
                    self.unregister_memory(done)
                self._last_error = error
                return -1
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        try:
            self._ready()
        except _Failure as f:
            return self._fail(f)
        result, error = 0, ""
        for addr in buffer_addresses:
            if self.unregister_memory(addr) != 0:  # the rest are still unregistered
                result, error = -1, self._last_error
        self._last_error = error
        return result

    # ---------------------------------------------------------- transfers

    def _peer(self, target):
        """peer_name(target) as C text, remembered (callers repeat targets)."""
        name = self._peers.get(target)
        if name is None:
            if len(self._peers) >= 4096:
                self._peers.clear()
            name = self._peers[target] = text(peer_name(target))
        return name

    def _sync1(self, target, opcode, buffer, peer, length):
        """One block: the common call, without building arrays."""
        try:
            e = self._ready()
            try:
                cols = _U64x3(buffer, peer, length)
            except TypeError as err:
                raise _Failure(f"addresses and lengths must be integers ({err})",
                               "INVALID_ARGUMENT")
            if cols[0] != buffer or cols[1] != peer or cols[2] != length:
                raise _Failure("addresses and lengths must be integers from 0 to 2**64-1",
                               "INVALID_ARGUMENT")
            base = ctypes.addressof(cols)
            self._call(lib.kvferry_transfer_sync(
                e, self._peer(target), int(opcode == TransferOpcode.Read), base, base + 8,
                base + 16, 1, int(self._timeout_for(length) * 1000)))
            return 0
        except _Failure as f:
            return self._fail(f)

    def _sync(self, target, opcode, buffers, peers, lengths, notify=None):
        try:
            e = self._ready()
            (local, remote, length), nbytes = self._columns(buffers, peers, lengths)
            self._call(lib.kvferry_transfer_sync(
                e, self._peer(target), int(opcode == TransferOpcode.Read), local[1],
                remote[1], length[1], local[2], int(self._timeout_for(nbytes) * 1000)))
            if notify is not None:
                message = _NOTIFY_TAG + _lib.blob(notify.name) + b"\0" + _lib.blob(notify.msg)
                self._call(lib.kvferry_notify(e, self._segment(target), message, len(message), 0))
            return 0
        except _Failure as f:
            return self._fail(f)

    def _async(self, target, opcode, buffers, peers, lengths):
        """A batch id (never 0), or 0 on failure."""
        try:
            e = self._ready()
            (local, remote, length), nbytes = self._columns(buffers, peers, lengths)
            segment = self._segment(target)
            batch = ctypes.c_uint64()
            self._call(lib.kvferry_submit_columns(
                e, segment, int(opcode == TransferOpcode.Read), local[1], remote[1], length[1],
                local[2], 0, ctypes.byref(batch)))
        except _Failure as f:
            return self._fail(f, 0)
        with self._mu:
            self._batches[batch.value] = (time.monotonic(), self._timeout_for(nbytes))
        return batch.value

    def _on_cuda(self, target, opcode, buffers, peers, lengths, stream):
        """Stream-ordered (Mooncake's *_on_cuda): the transfer starts once the
        work queued on `stream_ptr` (a cudaStream_t / CUstream as an integer;
        0: the legacy default stream) before the call has finished, and the
        stream's later work waits for it. Returns None at once; raises
        RuntimeError when it cannot be queued (no CUDA driver, no such peer,
        ...). A transfer that fails once queued is logged (Mooncake ends the
        process instead)."""
        try:
            e = self._ready()
            (local, remote, length), nbytes = self._columns(buffers, peers, lengths)
            segment = self._segment(target)
            out = ctypes.c_uint64()
            self._call(lib.kvferry_submit_on_stream(
                e, segment, int(opcode == TransferOpcode.Read), local[1], remote[1], length[1],
                local[2], stream or None, 1, int(self._timeout_for(nbytes) * 1000), 0,
                ctypes.byref(out)))
        except _Failure as f:
            self._fail(f)
            raise RuntimeError(self._last_error) from None

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length,
                            transport_hint=""):
        return self._sync1(target_hostname, TransferOpcode.Write, buffer, peer_buffer_address,
                           length)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length,
                           transport_hint=""):
        return self._sync1(target_hostname, TransferOpcode.Read, buffer, peer_buffer_address,
                           length)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Write, buffers, peer_buffer_addresses,
                          lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Read, buffers, peer_buffer_addresses,
                          lengths)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        return self._sync(target_hostname, opcode, [buffer], [peer_buffer_address], [length],
                          notify)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint=""):
        return self._sync(target_hostname, opcode, buffers, peer_buffer_addresses, lengths,
                          notify)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths, transport_hint=""):
        return self._async(target_hostname, TransferOpcode.Write, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        return self._async(target_hostname, TransferOpcode.Read, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint=""):
        return self._async(target_hostname, opcode, buffers, peer_buffer_addresses, lengths)

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                               stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, TransferOpcode.Write, [buffer], [peer_buffer_address],
                      [length], stream_ptr)

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                              stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, TransferOpcode.Read, [buffer], [peer_buffer_address],
                      [length], stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                     lengths, stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, TransferOpcode.Write, buffers, peer_buffer_addresses,
                      lengths, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                    lengths, stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, TransferOpcode.Read, buffers, peer_buffer_addresses,
                      lengths, stream_ptr)

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch: 0 when all completed, -1 when one failed or
        timed out. Completed batches are released."""
        try:
            e = self._ready()
        except _Failure as f:
            return self._fail(f)
        first = None
        status = _lib.BatchStatus()
        for batch in batch_ids:
            with self._mu:
                pending = self._batches.get(batch)
            if pending is None:
                first = first or _Failure(f"unknown batch {batch}", "NOT_FOUND")
                continue
            start, timeout = pending
            left = max(0.0, start + timeout - time.monotonic())
            rc = lib.kvferry_wait(e, batch, int(left * 1000), ctypes.byref(status))
            if status.pending == 0:
                self._forget(batch)
            if rc != _lib.OK and first is None:
                first = _Failure(_lib.last_error(), lib.kvferry_status_name(rc).decode())
        return self._fail(first) if first is not None else 0

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint=""):
        """A batch id, or 0 (never a batch id) when it cannot start, as Mooncake's."""
        return self._async(target_hostname, TransferOpcode.Write, [buffer],
                           [peer_buffer_address], [length])

    def transfer_check_status(self, batch_id):
        """1 completed, 0 pending, -1 failed, -2 past the timeout (Mooncake's)."""
        try:
            e = self._ready()
            with self._mu:
                pending = self._batches.get(batch_id)
            if pending is None:
                raise _Failure(f"unknown batch {batch_id}", "NOT_FOUND")
            status = _lib.BatchStatus()
            rc = lib.kvferry_poll(e, batch_id, ctypes.byref(status))
            if status.pending > 0 and rc == _lib.OK:
                start, timeout = pending
                return -2 if time.monotonic() - start > timeout else 0
            if status.pending == 0:
                self._forget(batch_id)
            self._call(rc)
            return 1
        except _Failure as f:
            return self._fail(f)

    def _forget(self, batch):
        lib.kvferry_release(self._e, batch)
        with self._mu:
            self._batches.pop(batch, None)

    # -------------------------------------------------------------- bytes

    def _inside_registered(self, what, address, length):
        """Raises unless [address, +length) lies in memory registered here
        (a raw pointer anywhere else could crash the process)."""
        if not isinstance(address, int) or not isinstance(length, int) or length < 0:
            raise _Failure(f"{what}: address and length must be non-negative integers",
                           "INVALID_ARGUMENT")
        with self._mu:
            for base, size in self._local.items():
                if base <= address and address + length <= base + size:
                    return
        raise _Failure(f"{what}: [{address:#x}, +{length}) is not inside memory registered "
                       "with this engine", "INVALID_ARGUMENT")

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        self._begin()
        try:
            self._inside_registered("write_bytes_to_buffer", dest_address, length)
        except _Failure as f:
            return self._fail(f)
        data = _lib.blob(src_ptr)
        if length > len(data):
            return self._fail(_Failure(f"write_bytes_to_buffer: length {length} exceeds the "
                                       f"{len(data)} bytes given", "INVALID_ARGUMENT"))
        ctypes.memmove(dest_address, data, length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """The bytes at [source_address, +length), which must lie in memory
        registered here; b"" (and the error logged) otherwise."""
        self._begin()
        try:
            self._inside_registered("read_bytes_from_buffer", source_address, length)
        except _Failure as f:
            return self._fail(f, b"")
        return ctypes.string_at(source_address, length)

    # ---------------------------------------------------------- the peers

    def get_local_topology(self, device_name=None):
        self._begin()
        out, n = ctypes.c_void_p(), ctypes.c_size_t()
        rc = lib.kvferry_local_topology(text(device_name or ""), ctypes.byref(out),
                                        ctypes.byref(n))
        if rc != _lib.OK:
            self._fail(_Failure(_lib.last_error(), lib.kvferry_status_name(rc).decode()))
            return "{}"
        return _lib.take_bytes(out, n).decode()

    def get_first_buffer_address(self, segment_name):
        """The first buffer of a segment: for this engine's own name, the
        oldest buffer still registered here (read live, as Mooncake's local
        segment); for a peer, its lowest registered address as of the last
        handshake."""
        try:
            e = self._ready()
            if peer_name(segment_name) == self._address:
                with self._mu:
                    if self._local:
                        return next(iter(self._local))
                raise _Failure(f"{segment_name} has registered no memory", "NOT_FOUND")
            segment = self._segment(segment_name)
            count = ctypes.c_size_t()
            regions = (_lib.Region * 1)()
            self._call(lib.kvferry_segment_regions(e, segment, regions, 1, ctypes.byref(count)))
            if count.value == 0:
                raise _Failure(f"{segment_name} has registered no memory", "NOT_FOUND")
            return regions[0].addr
        except _Failure as f:
            return self._fail(f, 0)

    def warmup_efa_segment(self, segment_name):
        """Opens the segment now: handshake and links before the first transfer."""
        try:
            self._ready()
            self._segment(segment_name)
            return 0
        except _Failure as f:
            return self._fail(f)

    def get_notifies(self):
        out = []
        try:
            e = self._ready()
        except _Failure as f:
            self._fail(f)
            return out
        sender, data, n = ctypes.c_uint64(), ctypes.c_void_p(), ctypes.c_size_t()
        while lib.kvferry_next_notification(e, 0, ctypes.byref(sender), ctypes.byref(data),
                                            ctypes.byref(n)) == _lib.OK:
            message = _lib.take_bytes(data, n)
            if message.startswith(_NOTIFY_TAG) and b"\0" in message:
                name, _, msg = message[len(_NOTIFY_TAG):].partition(b"\0")
                out.append(TransferNotify(name.decode(errors="replace"),
                                          msg.decode(errors="replace")))
            else:  # from a native notify
                out.append(TransferNotify("", message.decode(errors="replace")))
        self._begin()
        return out

    def send_probe(self, peer_server_name):
        try:
            e = self._ready()
            engine_id = ctypes.c_uint64()
            self._call(lib.kvferry_probe(e, text(peer_name(peer_server_name)), 5000,
                                         ctypes.byref(engine_id)))
            return 0
        except _Failure as f:
            return self._fail(f)
