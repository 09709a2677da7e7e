"""vLLM's NixlConnector, reduced to its calls on the `nixl` package: the
order, the arguments and the threads of vLLM's pull and push modes
(prefill "P", decode "D"), over a KV cache of host memory.

    vllm_shape.py prefill --rank R [--push] ...   serves its side channel,
        prints "SIDE <port>", frees a request's blocks once it has counted
        its notifications (pull), or WRITEs them into D's (push)
    vllm_shape.py decode --prefills PORT[,PORT] [--push] ...   reads (pull)
        or receives (push) every request, checks every byte, prints "OK"

With two prefill ports the decode runs at TP 1 against a prefill at TP 2:
each P rank holds half of every block, read into its half of D's block
through a split local list. --wait-for-go makes the decode stop after its
handshake until a line arrives on stdin (a test kills the prefill then);
--expect-failure makes it succeed only if every request then fails.

The side channel stands in for vLLM's ZMQ one: a TCP socket, one JSON
line each way. Memory is registered as DRAM; vLLM's GPU case differs only
in the mem type and device ids.
"""
import argparse
import array
import ctypes
import json
import socket
import sys
import threading
import time
import uuid

from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlXferTelemetry  # noqa: F401  (vLLM imports it with nixl_agent)

try:
    import numpy as np
except ImportError:  # this stand-in has numpy's shape where it matters
    np = None


class U64Matrix(array.array):
    """An Nx3 uint64 array like the numpy one vLLM passes (buffer protocol,
    shape, dtype), for interpreters without numpy."""
    def __new__(cls, rows):
        a = super().__new__(cls, "Q", [v for row in rows for v in row])
        a.shape = (len(rows), 3)
        a.dtype = "uint64"
        return a


class I64Vector(array.array):
    def __new__(cls, values):
        a = super().__new__(cls, "q", values)
        a.shape = (len(a),)
        a.dtype = "int64"
        return a


def matrix(rows):
    return np.array(rows, dtype=np.uint64) if np is not None else U64Matrix(rows)


def indices(values):
    return np.array(values, dtype=np.int64) if np is not None else I64Vector(values)


def pattern(rank, region, block, n):
    seed = (rank * 7 + region * 13 + block * 31) % 251
    base = bytes(range(256)) * (n // 256)
    return base[seed:] + base[:seed]


class KvCache:
    """`regions` regions (one per layer) of `blocks` blocks of `block_len`."""
    def __init__(self, regions, blocks, block_len):
        self.regions, self.blocks, self.block_len = regions, blocks, block_len
        self.buffers = [(ctypes.c_char * (blocks * block_len))() for _ in range(regions)]
        self.bases = [ctypes.addressof(b) for b in self.buffers]

    def block(self, region, block, offset=0, length=None):
        length = self.block_len if length is None else length
        start = block * self.block_len + offset
        return bytes(self.buffers[region][start:start + length])

    def fill(self, rank):
        for r in range(self.regions):
            for b in range(self.blocks):
                self.buffers[r][b * self.block_len:(b + 1) * self.block_len] = \
                    pattern(rank, r, b, self.block_len)

    def register(self, agent):
        # vLLM: one registration for the list of the cache's allocations.
        caches_data = [(base, self.blocks * self.block_len, 0, "") for base in self.bases]
        descs = agent.get_reg_descs(caches_data, "DRAM")
        agent.register_memory(descs, backends=["UCX"])
        return descs

    def block_descs(self, bases=None, offset=0, length=None):
        """vLLM's region-major list: entry r * blocks + b."""
        bases = bases or self.bases
        length = self.block_len if length is None else length
        return matrix([(base + b * self.block_len + offset, length, 0)
                       for base in bases for b in range(self.blocks)])


def make_agent():
    config = nixl_agent_config(num_threads=4, capture_telemetry=True)
    return nixl_agent(str(uuid.uuid4()), config)


def serve_side_channel(payload):
    """vLLM's side channel (ZMQ ROUTER): answers get_meta_msg with the
    handshake payload. Returns its port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def loop():
        while True:
            conn, _ = srv.accept()
            with conn, conn.makefile("rwb") as f:
                if json.loads(f.readline())[0] == "get_meta_msg":
                    f.write(json.dumps(payload).encode() + b"\n")
                    f.flush()
    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[1]


def fetch_side_channel(port, tp_rank=0):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, s.makefile("rwb") as f:
        f.write(json.dumps(["get_meta_msg", 0, tp_rank]).encode() + b"\n")
        f.flush()
        return json.loads(f.readline())


def request_blocks(req, blocks, count):
    """A request's scattered block ids on either side."""
    step = 7 if blocks % 7 else 5
    return [(req * 11 + k * step) % blocks for k in range(count)]


def prefill(args):
    agent = make_agent()
    cache = KvCache(args.regions, args.blocks, args.block_len)
    cache.fill(args.rank)
    cache.register(agent)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                  agent.get_xfer_descs(cache.block_descs(), "DRAM"))
    payload = {"agent_metadata": agent.get_agent_metadata().hex(), "engine_id": agent.name,
               "kv_caches_base_addr": cache.bases, "num_blocks": cache.blocks,
               "block_lens": [cache.block_len] * cache.regions}
    print(f"SIDE {serve_side_channel(payload)}", flush=True)
    deadline = time.monotonic() + args.timeout
    freed, counts = set(), {}
    pushes, writer_error = [], []
    if args.push:
        threading.Thread(target=push_writer, args=(agent, cache, local, pushes, writer_error,
                                                   args), name="nixl-push-writer",
                         daemon=True).start()
    while len(freed) < args.requests and time.monotonic() < deadline and not writer_error:
        if args.push:  # the engine thread polls the writer's transfers
            for entry in list(pushes):
                req, handle = entry
                if agent.check_xfer_state(handle) == "DONE":
                    agent.get_xfer_telemetry(handle)
                    agent.release_xfer_handle(handle)
                    pushes.remove(entry)
                    freed.add(req)
                    print(f"PUSHED {req}", flush=True)
        else:
            for _, msgs in agent.get_new_notifs().items():
                for m in msgs:
                    req, n = m.decode().rsplit(":", 1)
                    counts[req] = counts.get(req, 0) + 1
                    if counts[req] == int(n):
                        freed.add(req)
                        print(f"FREED {req}", flush=True)
        time.sleep(0.002)  # an engine step
    if writer_error:
        print(f"ERROR {writer_error[0]!r}", flush=True)
        return 1
    if len(freed) < args.requests:
        print(f"ERROR freed {len(freed)} of {args.requests}", flush=True)
        return 1
    time.sleep(0.2)  # let the last notifications' senders see them taken
    return 0


def push_writer(agent, cache, local, pushes, error, args):
    """vLLM's nixl-push-writer thread: takes D's registrations, handshakes
    with D, and WRITEs each finished request's blocks into D's."""
    remotes = {}
    try:
        while True:
            for _, msgs in agent.get_new_notifs().items():
                for m in msgs:
                    if m.startswith(b"HB:"):
                        continue
                    if not m.startswith(b"PUSH_REG:"):
                        raise RuntimeError(f"unexpected {m!r}")
                    reg = json.loads(m[len(b"PUSH_REG:"):])
                    if reg["engine_id"] not in remotes:
                        name = agent.add_remote_agent(bytes.fromhex(reg["agent_metadata"]))
                        d_cache = KvCache(len(reg["bases"]), reg["num_blocks"], cache.block_len)
                        descs = agent.get_xfer_descs(d_cache.block_descs(reg["bases"]), "DRAM")
                        remotes[reg["engine_id"]] = agent.prep_xfer_dlist(name, descs)
                    remote = remotes[reg["engine_id"]]
                    req = reg["request_id"]
                    p_blocks = request_blocks(int(req), cache.blocks, len(reg["block_ids"]))
                    lids = indices([r * cache.blocks + b for r in range(cache.regions)
                                    for b in p_blocks])
                    rids = indices([r * reg["num_blocks"] + b for r in range(cache.regions)
                                    for b in reg["block_ids"]])
                    handle = agent.make_prepped_xfer("WRITE", local, lids, remote, rids,
                                                     notif_msg=f"{req}:1".encode())
                    agent.transfer(handle)
                    pushes.append((req, handle))
            time.sleep(0.001)
    except Exception as e:  # noqa: BLE001 (reported by the main thread)
        error.append(e)


def decode(args):
    ports = [int(p) for p in args.prefills.split(",")]
    p_tp = len(ports)
    agent = make_agent()
    # D's block holds every P rank's share (TP 2 -> 1: two halves).
    cache = KvCache(args.regions, args.blocks, args.block_len * p_tp)
    cache.register(agent)
    full = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                 agent.get_xfer_descs(cache.block_descs(), "DRAM"))
    # The handshake thread (vllm-nixl-handshake-initiator): one per P rank,
    # and split local lists when P's TP is larger.
    remotes = [None] * p_tp
    local_for = [full] * p_tp

    def handshake():
        for rank, port in enumerate(ports):
            meta = fetch_side_channel(port, tp_rank=0)
            name = agent.add_remote_agent(bytes.fromhex(meta["agent_metadata"]))
            p_cache = KvCache(args.regions, meta["num_blocks"], meta["block_lens"][0])
            descs = agent.get_xfer_descs(p_cache.block_descs(meta["kv_caches_base_addr"]),
                                         "DRAM")
            remotes[rank] = (name, agent.prep_xfer_dlist(name, descs), meta)
            if p_tp > 1:
                local_for[rank] = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", agent.get_xfer_descs(
                        cache.block_descs(offset=rank * args.block_len, length=args.block_len),
                        "DRAM"))
    t = threading.Thread(target=handshake, name="vllm-nixl-handshake-initiator")
    t.start()
    while t.is_alive():  # the engine thread keeps stepping meanwhile
        agent.get_new_notifs()
        time.sleep(0.001)
    t.join()
    if any(r is None for r in remotes):
        print("ERROR handshake", flush=True)
        return 1
    print("READY", flush=True)
    if args.wait_for_go:
        sys.stdin.readline()

    plan = {}  # request -> (D block ids, P block ids)
    for i in range(args.requests):
        d_blocks = request_blocks(i * 3 + 1, cache.blocks, args.blocks_per_request)
        p_blocks = request_blocks(i, remotes[0][2]["num_blocks"], args.blocks_per_request)
        plan[str(i)] = (d_blocks, p_blocks)
    failures, done = [], set()
    if args.push:
        for req, (d_blocks, _) in plan.items():
            reg = {"request_id": req, "block_ids": d_blocks, "engine_id": agent.name,
                   "agent_metadata": agent.get_agent_metadata().hex(),
                   "bases": cache.bases, "num_blocks": cache.blocks}
            agent.send_notif(remotes[0][0], notif_msg=b"PUSH_REG:" + json.dumps(reg).encode())
        agent.send_notif(remotes[0][0], notif_msg=b"HB:" + ",".join(plan).encode())
        deadline = time.monotonic() + args.timeout
        while len(done) < len(plan) and time.monotonic() < deadline:
            for _, msgs in agent.get_new_notifs().items():
                for m in msgs:
                    done.add(m.decode().rsplit(":", 1)[0])
            time.sleep(0.002)
    else:
        inflight = []
        for req, (d_blocks, p_blocks) in plan.items():
            lids = indices([r * cache.blocks + b for r in range(args.regions) for b in d_blocks])
            for rank, (name, remote, meta) in enumerate(remotes):
                rids = indices([r * meta["num_blocks"] + b for r in range(args.regions)
                                for b in p_blocks])
                try:
                    handle = agent.make_prepped_xfer("READ", local_for[rank], lids, remote, rids,
                                                     notif_msg=f"{req}:1".encode())
                    agent.transfer(handle)
                    inflight.append((req, handle))
                except Exception as e:  # noqa: BLE001 (vLLM: the request fails)
                    failures.append((req, repr(e)))
        deadline = time.monotonic() + args.timeout
        while inflight and time.monotonic() < deadline:
            for entry in list(inflight):
                req, handle = entry
                try:
                    state = agent.check_xfer_state(handle)
                    if state == "DONE":
                        telemetry = agent.get_xfer_telemetry(handle)
                        assert telemetry.totalBytes > 0 and telemetry.descCount > 0
                        agent.release_xfer_handle(handle)
                        inflight.remove(entry)
                        done.add(req)
                    elif state != "PROC":
                        raise RuntimeError(f"state {state}")
                except Exception as e:  # noqa: BLE001
                    failures.append((req, repr(e)))
                    inflight.remove(entry)
                    agent.release_xfer_handle(handle)
            time.sleep(0.002)
        if inflight:
            print(f"ERROR {len(inflight)} transfers still in progress", flush=True)
            return 1
    if args.expect_failure:
        ok = failures and not done
        print(f"FAILED-CLEANLY {len(failures)} {failures[0][1] if failures else ''}", flush=True)
        return 0 if ok else 1
    if failures or len(done) < len(plan):
        print(f"ERROR done {len(done)} of {len(plan)}, failures {failures[:3]}", flush=True)
        return 1
    # Every byte of every request, from every P rank.
    bad = 0
    for req, (d_blocks, p_blocks) in plan.items():
        if args.push:
            p_blocks = request_blocks(int(req), remotes[0][2]["num_blocks"], len(d_blocks))
        for r in range(args.regions):
            for db, pb in zip(d_blocks, p_blocks):
                for rank in range(p_tp):
                    got = cache.block(r, db, rank * args.block_len, args.block_len)
                    if got != pattern(rank, r, pb, args.block_len):
                        bad += 1
    if bad:
        print(f"ERROR {bad} blocks differ", flush=True)
        return 1
    print(f"OK {len(plan)} requests", flush=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--prefills", default="")
    parser.add_argument("--push", action="store_true")
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-len", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--blocks-per-request", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--wait-for-go", action="store_true")
    parser.add_argument("--expect-failure", action="store_true")
    args = parser.parse_args()
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    sys.exit(main())
