// transfer_bench: the engine's throughput and latency, each beside a
// reference measured in the same run.
//
//   ./bazelw run -c opt //bench:transfer_bench                       # loopback
//   ./bazelw run -c opt //bench:transfer_bench -- --role=target --port=16000
//   ./bazelw run -c opt //bench:transfer_bench -- --role=initiator --peer=HOST:16000
//   ./bazelw run -c opt //bench:transfer_bench -- --sweep=4096,65536,1048576 --out=/tmp/s
//
// Roles: `loopback` runs an initiator and a target engine in this process;
// `target` serves a registered buffer (and a raw socket sink for the
// reference) until an initiator says it is done (or for ever with
// --forever); `initiator` finds the target by host:port alone.
//
// Modes:
//   bw:  WRITE (or READ) `block`-byte requests, `batch` per batch, two
//        batches in flight per thread, for --duration seconds, --bytes, or
//        --iters requests; MiB/s (2^20 bytes, as perftest), GB/s, ops/s and
//        the time of a batch (p50/p99/p999). A progress line per second on
//        runs longer than one. A batch's blocks are scattered by default,
//        as a KV cache's pages are: a block-sized gap after each, so that
//        every request is a slice of its own; --noscatter makes them
//        adjacent, and the engine then moves them in shared slices (up to
//        the slice size). The output says which ("scattered"/"adjacent").
//        The memcpy reference copies the same blocks; the socket reference
//        streams the same number of bytes in one run per connection either
//        way.
//   lat: ping-pong like ib_write_lat: the initiator WRITEs `block` bytes, the
//        target sees them land and WRITEs them back; half the round trip is
//        the one-way latency (p50/p99/p999). Each side, as ib_write_lat,
//        posts, then waits for its WRITE's completion (the responder's
//        acknowledgement), then for the other's message. With --prepared
//        each side posts one prepared transfer again and again instead of
//        submitting a batch a round.
//   layers: what a serving engine does when it sends each layer of a
//        request from its own thread: every round, --threads threads each
//        submit one batch of --batch scattered `block`-byte pages (every
//        other page of its own area) at the same moment and wait for it;
//        the same rounds then run with one thread. Prints both batch times
//        (p50/p99/max), their p99 ratio and how many batches took 40 ms or
//        more. --iters rounds (default 2000 is capped to 400 here).
//   --sweep=B1,B2,...: both modes at every block size, engine and reference
//        side by side; writes OUT.csv and, with gnuplot, OUT.png.
//   --prepared: nixlbench's measure on the engine's prepared transfers
//        (docs/nixl.md): for every block size (--sweep, or --block) and
//        batch size (--batches), one transfer of `batch` descriptors (block
//        j at j x stride, every other one or, with --noscatter, adjacent) is
//        prepared, then posted and polled to completion --iters times after
//        --warmup. Columns as nixlbench's: GB/s, the average latency per
//        descriptor, and the average and p99 of prepare (both lists plus
//        the transfer, timed apart over 20 rounds), post (inside Post) and
//        transfer (from Post's return to the poll that saw it done); then
//        the reference (--reference) moving the same bytes, as many blocks
//        in flight (two batches of half as many), and the ratio. The
//        RESULT line is the last row's rate (MiB/s).
//
// References (--reference): `memcpy` of the same bytes (the in-process path:
// two TCP-transport engines in one process copy without sockets), `socket`
// (a raw TCP stream of the same blocks, from and into the same places, to
// the target's sink, between the same processes, over as many connections
// as the engine has links), or
// `none`. `auto`: memcpy for loopback over TCP, socket for an initiator
// over TCP, none over RDMA (tools/softroce/bench.sh runs perftest and UCX
// beside it on the same device). Ratios are engine / reference.
//
// The last text line is "RESULT mode=... value=..." for scripts; --json
// prints one JSON object per measure instead.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "bench/raw_sink.h"
#include "engine/transfer_engine.h"
#include "net/socket.h"

ABSL_FLAG(std::string, role, "loopback", "loopback (both engines here), target or initiator");
ABSL_FLAG(std::string, peer, "", "initiator: the target's host:port");
ABSL_FLAG(std::string, mode, "bw",
          "bw (throughput), lat (ping-pong latency) or layers (threads sending a layer each "
          "at once, against one thread)");
ABSL_FLAG(std::string, op, "write", "bw mode: write or read");
ABSL_FLAG(std::string, transport, "auto",
          "auto, tcp or rdma (the simulated transport: //bench:scale_benchmark, //tools:simulate)");
ABSL_FLAG(std::string, devices, "", "RDMA devices to use, comma-separated (empty: all)");
ABSL_FLAG(std::string, host, "", "address to advertise (empty: detected; loopback: 127.0.0.1)");
ABSL_FLAG(uint32_t, port, 0, "target: handshake port (0: first free from 15000)");
ABSL_FLAG(uint64_t, block, 64 << 10, "bytes per request");
ABSL_FLAG(uint32_t, batch, 64, "bw mode: requests per batch (two batches in flight per thread)");
ABSL_FLAG(uint32_t, threads, 1, "bw mode: submitting threads");
ABSL_FLAG(bool, scatter, true,
          "bw mode and --prepared: every other block on both ends, as a KV cache's pages (no two "
          "requests adjacent, so each is a slice of its own); --noscatter: adjacent blocks, "
          "which the engine moves in shared slices");
ABSL_FLAG(uint32_t, links, 0,
          "links the engine opens to the peer (EngineOptions::links_per_peer; 0: the "
          "transport's choice); the socket reference opens as many connections as the engine "
          "did (or one per thread, if more)");
ABSL_FLAG(double, duration, 0, "seconds to run each measure (0: --bytes or --iters)");
ABSL_FLAG(uint64_t, bytes, 0, "bw mode: bytes to move (0: --iters)");
ABSL_FLAG(uint64_t, iters, 2000, "requests (bw) or round trips (lat) measured");
ABSL_FLAG(uint64_t, warmup, 100, "requests or round trips before measuring");
ABSL_FLAG(std::string, reference, "auto", "auto, memcpy, socket or none (see the file comment)");
ABSL_FLAG(uint32_t, rounds, 1,
          "engine and reference measured alternately this many times; the medians and the "
          "median of the per-round ratios are reported (for noisy machines)");
ABSL_FLAG(std::string, sweep, "",
          "block sizes to sweep, e.g. 4096,65536,1048576 ('default': 4 KiB..4 MiB)");
ABSL_FLAG(std::string, out, "transfer_bench_sweep", "sweep: writes OUT.csv and OUT.png");
ABSL_FLAG(uint64_t, buffer_mib, 256, "target: MiB of registered memory to serve");
ABSL_FLAG(bool, forever, false, "target: keep serving after an initiator is done");
ABSL_FLAG(bool, verbose, false, "engine logs at INFO");
ABSL_FLAG(bool, json, false, "print each result as one JSON object instead of text");
ABSL_FLAG(bool, prepared, false,
          "nixlbench's sweep on prepared transfers: block sizes (--sweep or --block) x batch "
          "sizes (--batches); with --mode=lat, the ping-pong posts prepared transfers");
ABSL_FLAG(std::string, batches, "1,4,16,64,256", "--prepared: batch sizes to sweep");

namespace kvferry {
namespace {

using transport::Opcode;

constexpr char kMetadataKey[] = "transfer_bench";
constexpr char kStopMark = static_cast<char>(255);  // ends a ping-pong

struct Percentiles {
  double p50 = 0, p99 = 0, p999 = 0;
};

Percentiles Summarize(std::vector<double> v) {
  Percentiles out;
  if (v.empty()) return out;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))]; };
  out.p50 = at(0.5);
  out.p99 = at(0.99);
  out.p999 = at(0.999);
  return out;
}

// When a measure ends: after a time, or after a number of units (requests
// or round trips).
struct Stop {
  absl::Duration duration = absl::ZeroDuration();
  uint64_t units = 0;
};

Stop StopFor(uint64_t block, bool bandwidth) {
  Stop s;
  const double d = absl::GetFlag(FLAGS_duration);
  if (d > 0) {
    s.duration = absl::Seconds(d);
  } else if (bandwidth && absl::GetFlag(FLAGS_bytes) > 0) {
    s.units = std::max<uint64_t>(1, absl::GetFlag(FLAGS_bytes) / block);
  } else {
    s.units = std::max<uint64_t>(1, absl::GetFlag(FLAGS_iters));
  }
  return s;
}

// ---------------------------------------------------------------- bandwidth

// Moves batch `half` (0 or 1) of thread `tid`: Start begins it, Finish
// waits for it. Each (tid, half) has its own part of both buffers.
class Mover {
 public:
  virtual ~Mover() = default;
  virtual absl::Status Start(int tid, int half) = 0;
  virtual absl::Status Finish(int tid, int half) = 0;
};

struct BwResult {
  double seconds = 0;
  double requests = 0;
  uint64_t block = 0;
  Percentiles batch_us;
  double gb_s() const { return requests * block / seconds / 1e9; }
  double mib_s() const { return requests * block / seconds / (1 << 20); }
  double ops_s() const { return requests / seconds; }
};

// Runs `threads` threads, each keeping two batches in flight.
absl::StatusOr<BwResult> DriveBandwidth(Mover& m, int threads, uint32_t batch, uint64_t block,
                                        const std::string& label) {
  // Warm-up on thread 0, then measure from an empty pipe.
  const uint64_t warm = (absl::GetFlag(FLAGS_warmup) + batch - 1) / batch;
  for (uint64_t n = 0; n < warm; ++n) {
    RETURN_IF_ERROR(m.Start(0, 0));
    RETURN_IF_ERROR(m.Finish(0, 0));
  }
  const Stop stop = StopFor(block, /*bandwidth=*/true);
  const uint64_t batches_per_thread =
      stop.units == 0
          ? 0
          : std::max<uint64_t>(1, (stop.units + threads * batch - 1) / (threads * batch));
  std::atomic<uint64_t> requests{0};
  std::atomic<bool> running{true};
  std::vector<std::vector<double>> lat(threads);
  std::vector<absl::Status> errors(threads);
  const absl::Time start = absl::Now();
  const absl::Time deadline =
      stop.duration > absl::ZeroDuration() ? start + stop.duration : absl::InfiniteFuture();
  auto worker = [&](int tid) {
    bool busy[2] = {false, false};
    absl::Time submitted[2];
    absl::Status st;
    auto finish = [&](int h) {
      st = m.Finish(tid, h);
      busy[h] = false;
      if (st.ok()) {
        lat[tid].push_back(absl::ToDoubleMicroseconds(absl::Now() - submitted[h]));
        requests.fetch_add(batch, std::memory_order_relaxed);
      }
    };
    for (uint64_t n = 0; st.ok(); ++n) {
      if (batches_per_thread > 0 ? n >= batches_per_thread : absl::Now() >= deadline) break;
      const int h = n % 2;
      if (busy[h]) finish(h);
      if (!st.ok()) break;
      submitted[h] = absl::Now();
      st = m.Start(tid, h);
      busy[h] = st.ok();
    }
    for (int h = 0; h < 2; ++h) {
      if (busy[h]) {
        absl::Status keep = st;
        finish(h);
        if (!keep.ok()) st = keep;
      }
    }
    errors[tid] = st;
  };
  // A progress line per second (stderr), for runs longer than one.
  std::thread progress([&] {
    uint64_t last = 0;
    absl::Time last_t = start;
    for (int s = 1; running.load(); ++s) {
      while (running.load() && absl::Now() < start + absl::Seconds(s)) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      if (!running.load()) break;
      const uint64_t now_req = requests.load();
      const absl::Time t = absl::Now();
      const double dt = absl::ToDoubleSeconds(t - last_t);
      std::fprintf(stderr, "[%3d s] %s %llu B: %.3f GB/s, %.0f ops/s\n", s, label.c_str(),
                   static_cast<unsigned long long>(block),
                   (now_req - last) * double(block) / dt / 1e9, (now_req - last) / dt);
      last = now_req;
      last_t = t;
    }
  });
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& t : pool) t.join();
  const absl::Time end = absl::Now();
  running = false;
  progress.join();
  for (const absl::Status& e : errors) RETURN_IF_ERROR(e);
  BwResult r;
  r.seconds = absl::ToDoubleSeconds(end - start);
  r.requests = static_cast<double>(requests.load());
  r.block = block;
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  r.batch_us = Summarize(std::move(all));
  return r;
}

// The distance between the starts of a batch's blocks: twice the block
// (scattered, the default), or the block itself with --noscatter.
uint64_t BwStride(uint64_t block) { return absl::GetFlag(FLAGS_scatter) ? 2 * block : block; }

// Where a thread's batches go: thread t, half h uses bytes
// [(2t+h)*batch*stride, +batch*stride) of both buffers.
uint64_t BwSpan(int threads, uint32_t batch, uint64_t block) {
  return uint64_t(threads) * 2 * batch * BwStride(block);
}

class EngineMover : public Mover {
 public:
  EngineMover(TransferEngine& e, SegmentId seg, char* local, uint64_t remote, int threads,
              uint32_t batch, uint64_t block, bool write)
      : e_(e), seg_(seg), reqs_(threads * 2), ids_(threads * 2) {
    for (int i = 0; i < threads * 2; ++i) {
      for (uint32_t j = 0; j < batch; ++j) {
        const uint64_t off = (uint64_t(i) * batch + j) * BwStride(block);
        reqs_[i].push_back(
            {write ? Opcode::kWrite : Opcode::kRead, local + off, remote + off, block});
      }
    }
  }
  absl::Status Start(int tid, int half) override {
    ASSIGN_OR_RETURN(ids_[2 * tid + half], e_.Submit(seg_, reqs_[2 * tid + half]));
    return absl::OkStatus();
  }
  absl::Status Finish(int tid, int half) override {
    const BatchId b = ids_[2 * tid + half];
    ASSIGN_OR_RETURN(BatchStatus s, e_.Wait(b, absl::Seconds(60)));
    if (!s.ok()) {
      if (!s.done()) return absl::DeadlineExceededError("a batch did not finish in 60 s");
      for (const absl::Status& r : s.requests) RETURN_IF_ERROR(r);
    }
    return e_.Release(b);
  }

 private:
  TransferEngine& e_;
  const SegmentId seg_;
  std::vector<std::vector<TransferRequest>> reqs_;
  std::vector<BatchId> ids_;
};

// The in-process reference: memcpy of the same bytes between the same
// buffers.
class MemcpyMover : public Mover {
 public:
  MemcpyMover(char* src, char* dst, uint32_t batch, uint64_t block)
      : src_(src), dst_(dst), batch_(batch), block_(block) {}
  absl::Status Start(int tid, int half) override {
    const uint64_t stride = BwStride(block_);
    const uint64_t base = (uint64_t(2 * tid + half) * batch_) * stride;
    for (uint32_t j = 0; j < batch_; ++j) {
      std::memcpy(dst_ + base + j * stride, src_ + base + j * stride, block_);
    }
    return absl::OkStatus();
  }
  absl::Status Finish(int, int) override { return absl::OkStatus(); }

 private:
  char* src_;
  char* dst_;
  const uint32_t batch_;
  const uint64_t block_;
};

// The TCP reference: a raw stream of the same bytes to the sink over as
// many connections as the engine has links (--links), or one per thread if
// there are more threads: the engine's blocks from the same places into
// the same places (one sendmsg gathers a part's header and blocks).
// Thread t owns connections t, t + threads, ... and spreads each
// batch over them in parts of consecutive blocks; the sink answers one
// byte per part.
class SocketMover : public Mover {
 public:
  static absl::StatusOr<std::unique_ptr<SocketMover>> Connect(const std::string& sink, char* src,
                                                              int threads, uint32_t batch,
                                                              uint64_t block, int links) {
    auto m = std::unique_ptr<SocketMover>(new SocketMover(src, threads, batch, block));
    const int conns = std::max(threads, links);
    for (int c = 0; c < conns; ++c) {
      ASSIGN_OR_RETURN(net::Fd fd, bench::RawConnect(sink));
      m->fds_.push_back(std::move(fd));
    }
    return m;
  }
  absl::Status Start(int tid, int half) override {
    // The engine's blocks (EngineMover): every other one with --scatter.
    const uint64_t stride = BwStride(block_);
    const char* base = src_ + uint64_t(2 * tid + half) * batch_ * stride;
    const std::vector<int> mine = Mine(tid);
    uint32_t sent = 0;
    for (size_t k = 0; k < mine.size(); ++k) {
      const uint32_t count = Part(k, mine.size());
      if (count == 0) continue;
      // The same range of the sink as of the source: connections never
      // write the same bytes at once.
      const char* first = base + sent * stride;
      RETURN_IF_ERROR(bench::RawSend(fds_[mine[k]].get(), first, count, block_,
                                     static_cast<uint64_t>(first - src_), stride));
      sent += count;
    }
    return absl::OkStatus();
  }
  absl::Status Finish(int tid, int) override {
    const std::vector<int> mine = Mine(tid);
    for (size_t k = 0; k < mine.size(); ++k) {
      if (Part(k, mine.size()) == 0) continue;
      RETURN_IF_ERROR(bench::RawAwaitAck(fds_[mine[k]].get(), absl::Now() + absl::Seconds(60)));
    }
    return absl::OkStatus();
  }
  size_t connections() const { return fds_.size(); }

 private:
  SocketMover(char* src, int threads, uint32_t batch, uint64_t block)
      : src_(src), threads_(threads), batch_(batch), block_(block) {}
  std::vector<int> Mine(int tid) const {
    std::vector<int> out;
    for (int c = tid; c < static_cast<int>(fds_.size()); c += threads_) out.push_back(c);
    return out;
  }
  // Blocks of a batch that go on the k-th of n connections.
  uint32_t Part(size_t k, size_t n) const {
    return static_cast<uint32_t>(batch_ / n + (k < batch_ % n ? 1 : 0));
  }
  char* src_;
  const int threads_;
  const uint32_t batch_;
  const uint64_t block_;
  std::vector<net::Fd> fds_;
};

// ---------------------------------------------------------------- latency

// Reads a byte the transport writes behind our back (the NIC's DMA, the
// TCP transport's recv, the in-process copy), as perftest's latency tests
// do. Not a synchronisation ThreadSanitizer can see, so not instrumented.
__attribute__((no_sanitize("thread"))) char Peek(const char* p) {
  return *reinterpret_cast<const volatile char*>(p);
}
__attribute__((no_sanitize("thread"))) void Poke(char* p, char v) {
  *reinterpret_cast<volatile char*>(p) = v;
}

absl::Status FinishOne(TransferEngine& e, BatchId b) {
  ASSIGN_OR_RETURN(BatchStatus s, e.Wait(b, absl::Seconds(60)));
  if (!s.ok()) {
    return s.done() ? s.requests[0] : absl::DeadlineExceededError("a WRITE did not finish in 60 s");
  }
  return e.Release(b);
}

// The WRITE a ping-pong sends each round, of `block` bytes from `from` to
// `to` at the peer: a one-request batch through Submit each time, or
// (--prepared) one prepared transfer, made once and posted again.
class PingWrite {
 public:
  static absl::StatusOr<std::unique_ptr<PingWrite>> Make(TransferEngine& e, SegmentId segment,
                                                         char* from, uint64_t to, uint64_t block,
                                                         bool prepared) {
    auto w = std::unique_ptr<PingWrite>(new PingWrite(e, segment, from, to, block));
    if (!prepared) return w;
    PreparedTransfers& p = e.prepared();
    const Descriptor mine{reinterpret_cast<uintptr_t>(from), block}, theirs{to, block};
    ASSIGN_OR_RETURN(w->local_, p.PrepareLocal({&mine, 1}));
    ASSIGN_OR_RETURN(w->remote_, p.PrepareRemote(segment, {&theirs, 1}));
    const int64_t first = 0;
    ASSIGN_OR_RETURN(w->xfer_,
                     p.Make(Opcode::kWrite, w->local_, {&first, 1}, w->remote_, {&first, 1}));
    return w;
  }
  ~PingWrite() {
    if (xfer_ == 0) return;
    PreparedTransfers& p = e_.prepared();
    (void)p.Release(xfer_);
    (void)p.ReleaseList(local_);
    (void)p.ReleaseList(remote_);
  }
  PingWrite(const PingWrite&) = delete;
  PingWrite& operator=(const PingWrite&) = delete;

  absl::Status Post() {
    if (xfer_ != 0) return e_.prepared().Post(xfer_).status();
    TransferRequest w{Opcode::kWrite, from_, to_, block_};
    ASSIGN_OR_RETURN(batch_, e_.Submit(segment_, {&w, 1}));
    return absl::OkStatus();
  }
  // Waits until the last post's WRITE is acknowledged (60 s at most).
  absl::Status Finish() {
    if (xfer_ == 0) {
      const BatchId b = batch_;
      batch_ = 0;
      return b == 0 ? absl::OkStatus() : FinishOne(e_, b);
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (uint32_t spins = 0;; ++spins) {
      ASSIGN_OR_RETURN(XferState st, e_.prepared().State(xfer_));
      if (st != XferState::kInProgress) return absl::OkStatus();
      if ((spins & 0xfff) == 0 && absl::Now() > give_up) {
        return absl::DeadlineExceededError("a prepared WRITE did not finish in 60 s");
      }
    }
  }

 private:
  PingWrite(TransferEngine& e, SegmentId segment, char* from, uint64_t to, uint64_t block)
      : e_(e), segment_(segment), from_(from), to_(to), block_(block) {}
  TransferEngine& e_;
  const SegmentId segment_;
  char* const from_;
  const uint64_t to_, block_;
  BatchId batch_ = 0;                           // Submit's, until finished
  uint64_t local_ = 0, remote_ = 0, xfer_ = 0;  // --prepared
};

// Waits until the byte at `last` is `want` or the stop mark; false on the
// stop mark, `failed`, or nothing for `patience`.
bool AwaitMark(const char* last, char want, const std::atomic<bool>& failed,
               absl::Duration patience) {
  const absl::Time give_up = absl::Now() + patience;
  for (uint32_t spins = 0;; ++spins) {
    const char c = Peek(last);
    if (c == want) return true;
    if (c == kStopMark || failed.load(std::memory_order_relaxed)) return false;
    if ((spins & 0xffff) == 0 && absl::Now() > give_up) return false;
  }
}

// The target's half of a ping-pong: every message that lands in
// [recv, +block) is written back from one of two send buffers in turn to
// `remote` at the peer, until the stop mark arrives.
absl::Status Echo(TransferEngine& e, SegmentId to_initiator, char* recv, char* send[2],
                  uint64_t remote, uint64_t block, bool prepared, std::atomic<bool>& failed) {
  std::unique_ptr<PingWrite> out[2];
  absl::Status s;
  for (int i = 0; i < 2 && s.ok(); ++i) {
    absl::StatusOr<std::unique_ptr<PingWrite>> w =
        PingWrite::Make(e, to_initiator, send[i], remote, block, prepared);
    s = w.status();
    if (w.ok()) out[i] = std::move(*w);
  }
  for (uint64_t r = 1; s.ok(); ++r) {
    const char mark = static_cast<char>(r % 251 + 1);
    if (!AwaitMark(&recv[block - 1], mark, failed, absl::Seconds(30))) break;
    send[r % 2][block - 1] = mark;
    // Like ib_write_lat, the previous round's WRITE is finished only once
    // the next message is in (by then it has long completed).
    s = out[r % 2]->Post();
    if (s.ok()) s = out[(r + 1) % 2]->Finish();
  }
  for (int i = 0; i < 2; ++i) {
    if (out[i] != nullptr && s.ok()) s = out[i]->Finish();
  }
  Poke(&recv[block - 1], 0);
  if (!s.ok()) failed = true;
  return s;
}

struct LatResult {
  size_t rounds = 0;
  Percentiles one_way_us;
};

// The initiator's half: WRITEs `send` to `remote`, waits for the echo in
// `recv`; ends by sending the stop mark. As ib_write_lat, each round posts,
// waits for its own WRITE's completion, then for the echo.
absl::StatusOr<LatResult> Ping(TransferEngine& e, SegmentId to_target, char* send, char* recv,
                               uint64_t remote, uint64_t block, bool prepared,
                               std::atomic<bool>& failed) {
  const uint64_t warmup = absl::GetFlag(FLAGS_warmup);
  const Stop stop = StopFor(block, /*bandwidth=*/false);
  std::vector<double> half_rtt_us;
  absl::StatusOr<std::unique_ptr<PingWrite>> made =
      PingWrite::Make(e, to_target, send, remote, block, prepared);
  absl::Status st = made.status();
  absl::Time measure_start;
  for (uint64_t r = 1; st.ok(); ++r) {
    if (r == warmup + 1) measure_start = absl::Now();
    if (r > warmup &&
        (stop.units > 0 ? r > warmup + stop.units : absl::Now() - measure_start >= stop.duration)) {
      break;
    }
    const char mark = static_cast<char>(r % 251 + 1);
    send[block - 1] = mark;
    const absl::Time t0 = absl::Now();
    st = (*made)->Post();
    if (st.ok()) st = (*made)->Finish();
    if (!st.ok()) break;
    const bool echoed = AwaitMark(&recv[block - 1], mark, failed, absl::Seconds(30));
    const absl::Time t1 = absl::Now();
    if (!echoed) st = absl::DeadlineExceededError("no echo from the target in 30 s");
    if (st.ok() && r > warmup) half_rtt_us.push_back(absl::ToDoubleMicroseconds(t1 - t0) / 2);
  }
  // The stop mark ends the echo (also after a failure).
  send[block - 1] = kStopMark;
  TransferRequest w{Opcode::kWrite, send, remote, block};
  absl::StatusOr<BatchId> b = e.Submit(to_target, {&w, 1});
  if (b.ok()) (void)FinishOne(e, *b);
  Poke(&recv[block - 1], 0);
  if (!st.ok()) {
    failed = true;
    return st;
  }
  return LatResult{half_rtt_us.size(), Summarize(std::move(half_rtt_us))};
}

// Reference latencies: a memcpy of the block, or a raw socket echo.
absl::StatusOr<LatResult> ReferenceLatency(const std::string& kind, char* a, char* b,
                                           uint64_t block, const std::string& sink) {
  const Stop stop = StopFor(block, /*bandwidth=*/false);
  const uint64_t warmup = absl::GetFlag(FLAGS_warmup);
  net::Fd fd;
  if (kind == "socket") {
    ASSIGN_OR_RETURN(fd, bench::RawConnect(sink));
  }
  std::vector<double> us;
  absl::Time measure_start;
  for (uint64_t r = 1;; ++r) {
    if (r == warmup + 1) measure_start = absl::Now();
    if (r > warmup &&
        (stop.units > 0 ? r > warmup + stop.units : absl::Now() - measure_start >= stop.duration)) {
      break;
    }
    const absl::Time t0 = absl::Now();
    if (kind == "memcpy") {
      std::memcpy(b, a, block);
      asm volatile("" : : "g"(b) : "memory");  // the copy is not optimized away
    } else {
      RETURN_IF_ERROR(bench::RawEcho(fd.get(), a, b, block));
    }
    const double t = absl::ToDoubleMicroseconds(absl::Now() - t0);
    // memcpy is one way already; a socket echo is a round trip.
    if (r > warmup) us.push_back(kind == "memcpy" ? t : t / 2);
  }
  return LatResult{us.size(), Summarize(std::move(us))};
}

// ---------------------------------------------------------------- sessions

[[noreturn]] void Die(const absl::Status& s) {
  std::fprintf(stderr, "transfer_bench: %s\n", std::string(s.message()).c_str());
  std::exit(1);
}

EngineOptions Options(const std::string& role) {
  EngineOptions o;
  o.local_host = absl::GetFlag(FLAGS_host);
  if (o.local_host.empty() && role == "loopback") o.local_host = "127.0.0.1";
  o.transport = absl::GetFlag(FLAGS_transport);
  const std::string devices = absl::GetFlag(FLAGS_devices);
  if (!devices.empty()) o.devices = absl::StrSplit(devices, ',', absl::SkipEmpty());
  if (role == "target") o.port = static_cast<uint16_t>(absl::GetFlag(FLAGS_port));
  o.links_per_peer = absl::GetFlag(FLAGS_links);
  return o;
}

// The initiator's view: its engine and buffer, the target's buffer, and
// (loopback) the target engine itself.
struct Session {
  std::unique_ptr<TransferEngine> initiator;
  std::unique_ptr<TransferEngine> target;  // loopback only
  std::vector<char> local;
  std::vector<char> target_buffer;  // loopback only
  SegmentId to_target = 0;
  SegmentId to_initiator = 0;  // loopback only
  uint64_t remote = 0;         // the target's buffer
  uint64_t remote_len = 0;
  bench::RawSink* sink = nullptr;  // loopback socket reference (lives as long as the process)
  std::string sink_address;
  std::string reference;  // resolved: memcpy, socket or none
};

absl::Status OpenSession(Session& s, const std::string& role, uint64_t max_block, int threads,
                         uint32_t batch) {
  const uint64_t arena = std::max(BwSpan(threads, batch, max_block), 3 * max_block);
  ASSIGN_OR_RETURN(s.initiator, TransferEngine::Create(Options(role)));
  s.local.assign(arena, 'x');
  const absl::Time registering = absl::Now();
  RETURN_IF_ERROR(s.initiator->RegisterMemory(s.local.data(), s.local.size()));
  if (absl::GetFlag(FLAGS_verbose)) {
    std::fprintf(stderr, "transfer_bench: registered %.1f MiB on %s in %.2f ms\n",
                 arena / 1048576.0, s.initiator->detection().devices.c_str(),
                 absl::ToDoubleMilliseconds(absl::Now() - registering));
  }
  if (role == "loopback") {
    ASSIGN_OR_RETURN(s.target, TransferEngine::Create(Options(role)));
    s.target_buffer.assign(arena, 0);
    RETURN_IF_ERROR(s.target->RegisterMemory(s.target_buffer.data(), s.target_buffer.size(),
                                             transport::Access::kRemoteReadWrite));
    ASSIGN_OR_RETURN(s.to_target, s.initiator->OpenSegment(s.target->address()));
    ASSIGN_OR_RETURN(s.to_initiator, s.target->OpenSegment(s.initiator->address()));
    s.remote = reinterpret_cast<uintptr_t>(s.target_buffer.data());
    s.remote_len = arena;
  } else {
    const std::string peer = absl::GetFlag(FLAGS_peer);
    if (peer.empty()) return absl::InvalidArgumentError("--role=initiator needs --peer=HOST:PORT");
    ASSIGN_OR_RETURN(s.to_target, s.initiator->OpenSegment(peer));
    ASSIGN_OR_RETURN(std::string meta, s.initiator->FetchMetadata(s.to_target, kMetadataKey));
    std::vector<std::string> parts = absl::StrSplit(meta, ' ');
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &s.remote) ||
        !absl::SimpleAtoi(parts[1], &s.remote_len)) {
      return absl::FailedPreconditionError(
          absl::StrCat(peer, " is not a transfer_bench target (metadata \"", meta, "\")"));
    }
    s.sink_address = parts[2];
    if (s.remote_len < arena) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the target serves %d MiB; %d thread(s) x 2 batches x %u x %d B need %d MiB: start "
          "it with a larger --buffer_mib",
          s.remote_len >> 20, threads, batch, max_block, (arena + (1 << 20) - 1) >> 20));
    }
  }
  std::string ref = absl::GetFlag(FLAGS_reference);
  const std::string transport = s.initiator->detection().transport;
  if (ref == "auto") {
    ref = transport != "tcp" ? "none" : role == "loopback" ? "memcpy" : "socket";
  }
  if (ref != "memcpy" && ref != "socket" && ref != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--reference must be auto, memcpy, socket or none, not \"", ref, "\""));
  }
  if (ref == "socket" && role == "loopback") {
    ASSIGN_OR_RETURN(s.sink, bench::RawSink::Start("127.0.0.1", s.target_buffer.data(), arena));
    s.sink_address = s.sink->address();
  }
  s.reference = ref;
  return absl::OkStatus();
}

// The target process: serves its buffer and the sink, echoes ping-pongs.
int ServeTarget() {
  auto engine = TransferEngine::Create(Options("target"));
  if (!engine.ok()) Die(engine.status());
  TransferEngine& e = **engine;
  const uint64_t len = absl::GetFlag(FLAGS_buffer_mib) << 20;
  if (len == 0) Die(absl::InvalidArgumentError("--buffer_mib must be positive"));
  std::vector<char> buffer(len, 0);
  // Initiators write and read it (--op=read).
  absl::Status st = e.RegisterMemory(buffer.data(), len, transport::Access::kRemoteReadWrite);
  if (!st.ok()) Die(st);
  auto sink = bench::RawSink::Start(
      e.detection().bind_host.empty() ? e.detection().host : e.detection().bind_host, buffer.data(),
      len);
  if (!sink.ok()) Die(sink.status());
  st = e.PublishMetadata(kMetadataKey, absl::StrCat(reinterpret_cast<uintptr_t>(buffer.data()), " ",
                                                    len, " ", (*sink)->address()));
  if (!st.ok()) Die(st);
  std::printf(
      "target ready at %s over %s, %llu MiB registered; run\n"
      "  transfer_bench --role=initiator --peer=%s\n",
      e.address().c_str(), e.detection().transport.c_str(),
      static_cast<unsigned long long>(len >> 20), e.address().c_str());
  std::fflush(stdout);
  for (;;) {
    auto n = e.WaitNotification(absl::Hours(24));
    if (!n.ok()) continue;
    std::vector<std::string> w = absl::StrSplit(n->message, ' ');
    if (w[0] == "done") {
      std::printf("initiator %llx is done\n", static_cast<unsigned long long>(n->engine_id));
      std::fflush(stdout);
      if (!absl::GetFlag(FLAGS_forever)) return 0;
      continue;
    }
    uint64_t remote = 0, block = 0;
    const bool prepared = w.size() == 5 && w[4] == "prepared";
    if ((w.size() != 4 && !prepared) || w[0] != "lat" || !absl::SimpleAtoi(w[2], &remote) ||
        !absl::SimpleAtoi(w[3], &block) || block == 0 || 3 * block > len) {
      KVF_LOG(WARNING) << "transfer_bench: ignored notification \"" << n->message << "\"";
      continue;
    }
    auto back = e.OpenSegment(w[1]);
    if (back.ok()) st = e.Notify(*back, "ready");
    if (!back.ok() || !st.ok()) {
      KVF_LOG(WARNING) << "transfer_bench: cannot answer " << w[1] << ": "
                       << (back.ok() ? st : back.status());
      continue;
    }
    std::atomic<bool> failed{false};
    char* send[2] = {buffer.data() + len - 2 * block, buffer.data() + len - block};
    st = Echo(e, *back, buffer.data(), send, remote, block, prepared, failed);
    if (!st.ok()) KVF_LOG(WARNING) << "transfer_bench: ping-pong ended: " << st;
  }
}

// ---------------------------------------------------------------- layers

struct LayerResult {
  Percentiles us;
  double max_us = 0;
  uint64_t batches = 0;
  uint64_t slow = 0;  // batches of 40 ms or more
};

// `rounds` rounds of `threads` threads that each submit one batch of
// `batch` pages at once (released together) and wait for it.
absl::StatusOr<LayerResult> DriveLayers(Session& s, int threads, uint32_t batch, uint64_t block,
                                        uint64_t rounds) {
  std::vector<std::vector<TransferRequest>> reqs(threads);
  for (int t = 0; t < threads; ++t) {
    for (uint32_t j = 0; j < batch; ++j) {
      const uint64_t off = (uint64_t(t) * 2 * batch + 2 * j) * block;  // every other page
      reqs[t].push_back({Opcode::kWrite, s.local.data() + off, s.remote + off, block});
    }
  }
  std::vector<std::vector<double>> lat(threads);
  std::vector<absl::Status> errors(threads);
  std::atomic<uint64_t> arrived{0};
  auto worker = [&](int tid) {
    BatchStatus status;
    for (uint64_t r = 0; r < rounds; ++r) {
      // All threads start a round together, as the layers of one request.
      arrived.fetch_add(1);
      while (arrived.load() < (r + 1) * threads) std::this_thread::yield();
      const absl::Time start = absl::Now();
      absl::StatusOr<BatchId> b = s.initiator->Submit(s.to_target, reqs[tid]);
      absl::Status st = b.status();
      if (st.ok()) st = s.initiator->Wait(*b, absl::Seconds(60), &status);
      if (st.ok() && !status.ok()) {
        st = absl::InternalError("a layer's batch failed");
        for (const absl::Status& q : status.requests) {
          if (!q.ok()) st = q;
        }
      }
      if (b.ok() && status.done()) (void)s.initiator->Release(*b);
      if (!st.ok()) {
        errors[tid] = st;
        // Keep the barrier going for the others.
        for (++r; r < rounds; ++r) arrived.fetch_add(1);
        return;
      }
      lat[tid].push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& t : pool) t.join();
  for (const absl::Status& e : errors) RETURN_IF_ERROR(e);
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  LayerResult out;
  out.batches = all.size();
  for (double v : all) {
    out.max_us = std::max(out.max_us, v);
    if (v >= 40000) ++out.slow;
  }
  out.us = Summarize(std::move(all));
  return out;
}

int MeasureLayers(Session& s, int threads, uint32_t batch, uint64_t block) {
  const uint64_t rounds =
      std::min<uint64_t>(400, std::max<uint64_t>(1, absl::GetFlag(FLAGS_iters)));
  const uint64_t warm = std::min<uint64_t>(50, absl::GetFlag(FLAGS_warmup));
  if (warm > 0 && !DriveLayers(s, threads, batch, block, warm).ok()) {
    std::fprintf(stderr, "transfer_bench: warm-up failed\n");
  }
  absl::StatusOr<LayerResult> many = DriveLayers(s, threads, batch, block, rounds);
  if (!many.ok()) Die(many.status());
  absl::StatusOr<LayerResult> one = DriveLayers(s, 1, batch, block, rounds);
  if (!one.ok()) Die(one.status());
  const double ratio = one->us.p99 > 0 ? many->us.p99 / one->us.p99 : 0;
  const std::string transport = s.initiator->detection().transport;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"mode\": \"layers\", \"transport\": \"%s\", \"block\": %llu, \"batch\": %u, "
        "\"threads\": %d, \"rounds\": %llu, \"p50_us\": %.1f, \"p99_us\": %.1f, "
        "\"max_us\": %.1f, \"slow\": %llu, \"one_thread_p50_us\": %.1f, "
        "\"one_thread_p99_us\": %.1f, \"p99_ratio\": %.3f}\n",
        transport.c_str(), static_cast<unsigned long long>(block), batch, threads,
        static_cast<unsigned long long>(rounds), many->us.p50, many->us.p99, many->max_us,
        static_cast<unsigned long long>(many->slow), one->us.p50, one->us.p99, ratio);
    return 0;
  }
  std::printf("layers over %s: %u pages of %llu B per batch, %llu rounds\n", transport.c_str(),
              batch, static_cast<unsigned long long>(block),
              static_cast<unsigned long long>(rounds));
  std::printf(
      "  %2d threads at once: batch p50 %.1f us  p99 %.1f us  max %.1f us  >= 40 ms: %llu of "
      "%llu\n",
      threads, many->us.p50, many->us.p99, many->max_us,
      static_cast<unsigned long long>(many->slow), static_cast<unsigned long long>(many->batches));
  std::printf(
      "   1 thread         : batch p50 %.1f us  p99 %.1f us  max %.1f us  >= 40 ms: %llu of %llu\n",
      one->us.p50, one->us.p99, one->max_us, static_cast<unsigned long long>(one->slow),
      static_cast<unsigned long long>(one->batches));
  std::printf("  p99 ratio (%d threads / 1 thread): %.2f\n", threads, ratio);
  std::printf("RESULT mode=layers block=%llu value=%.3f unit=p99_ratio\n",
              static_cast<unsigned long long>(block), ratio);
  return 0;
}

// ---------------------------------------------------------------- measures

std::string OpName(bool write) { return write ? "write" : "read"; }

std::string RoundsNote() {
  const uint32_t rounds = absl::GetFlag(FLAGS_rounds);
  return rounds > 1 ? absl::StrCat(" (median of ", rounds, " alternating rounds)") : "";
}

// The links the initiator's engine has to the target (its metrics).
int EngineLinks(const Session& s) {
  uint32_t links = 1;
  for (const PeerMetrics& p : s.initiator->GetMetrics().peers) links = std::max(links, p.links);
  return static_cast<int>(links);
}

absl::StatusOr<std::optional<BwResult>> ReferenceBandwidth(Session& s, int threads, uint32_t batch,
                                                           uint64_t block, bool write) {
  if (s.reference == "none") return std::optional<BwResult>();
  std::unique_ptr<Mover> m;
  if (s.reference == "memcpy") {
    char* a = s.local.data();
    char* b = s.target_buffer.empty() ? s.local.data() + BwSpan(threads, batch, block) / 2
                                      : s.target_buffer.data();
    if (s.target_buffer.empty()) batch = std::max<uint32_t>(1, batch / 2);
    m = std::make_unique<MemcpyMover>(write ? a : b, write ? b : a, batch, block);
  } else {
    ASSIGN_OR_RETURN(m, SocketMover::Connect(s.sink_address, s.local.data(), threads, batch, block,
                                             EngineLinks(s)));
  }
  ASSIGN_OR_RETURN(BwResult r, DriveBandwidth(*m, threads, batch, block, s.reference));
  return std::optional<BwResult>(r);
}

absl::StatusOr<LatResult> EngineLatency(Session& s, uint64_t block) {
  const bool prepared = absl::GetFlag(FLAGS_prepared);
  std::atomic<bool> failed{false};
  char* send = s.local.data();
  char* recv = s.local.data() + block;
  Poke(&recv[block - 1], 0);
  const uint64_t recv_addr = reinterpret_cast<uintptr_t>(recv);
  if (s.target) {
    char* trecv = s.target_buffer.data();
    char* tsend[2] = {trecv + block, trecv + 2 * block};
    Poke(&trecv[block - 1], 0);
    absl::Status echo;
    std::thread t([&] {
      echo = Echo(*s.target, s.to_initiator, trecv, tsend, recv_addr, block, prepared, failed);
    });
    auto r = Ping(*s.initiator, s.to_target, send, recv, s.remote, block, prepared, failed);
    t.join();
    if (r.ok() && !echo.ok()) return echo;
    return r;
  }
  // Ask the target to open a segment back and echo; it answers "ready".
  (void)s.initiator->TakeNotifications();
  RETURN_IF_ERROR(
      s.initiator->Notify(s.to_target, absl::StrCat("lat ", s.initiator->address(), " ", recv_addr,
                                                    " ", block, prepared ? " prepared" : "")));
  ASSIGN_OR_RETURN(Notification n, s.initiator->WaitNotification(absl::Seconds(30)));
  if (n.message != "ready") {
    return absl::FailedPreconditionError(absl::StrCat("the target answered \"", n.message, "\""));
  }
  return Ping(*s.initiator, s.to_target, send, recv, s.remote, block, prepared, failed);
}

template <typename T>
T MedianBy(std::vector<T> v, double (*key)(const T&)) {
  std::sort(v.begin(), v.end(), [key](const T& a, const T& b) { return key(a) < key(b); });
  return v[v.size() / 2];
}

// Engine and reference figures over --rounds alternating rounds: the
// medians, and the median of the per-round ratios engine / reference.
template <typename R>
struct Paired {
  R engine;
  std::optional<R> ref;
  double ratio = 0;
};

template <typename R>
absl::StatusOr<Paired<R>> Alternate(
    const std::function<absl::StatusOr<R>()>& engine,
    const std::function<absl::StatusOr<std::optional<R>>()>& reference,
    double (*figure)(const R&)) {
  const uint32_t rounds = std::max<uint32_t>(1, absl::GetFlag(FLAGS_rounds));
  std::vector<R> mine, theirs;
  std::vector<double> ratios;
  for (uint32_t i = 0; i < rounds; ++i) {
    ASSIGN_OR_RETURN(R e, engine());
    mine.push_back(e);
    ASSIGN_OR_RETURN(std::optional<R> r, reference());
    if (r) {
      theirs.push_back(*r);
      ratios.push_back(figure(e) / figure(*r));
    }
  }
  Paired<R> out;
  out.engine = MedianBy<R>(mine, figure);
  if (!theirs.empty()) {
    out.ref = MedianBy<R>(theirs, figure);
    std::sort(ratios.begin(), ratios.end());
    out.ratio = ratios[ratios.size() / 2];
  }
  return out;
}

using BwPair = Paired<BwResult>;

absl::StatusOr<BwPair> MeasureBw(Session& s, int threads, uint32_t batch, uint64_t block,
                                 bool write) {
  return Alternate<BwResult>(
      [&]() -> absl::StatusOr<BwResult> {
        EngineMover m(*s.initiator, s.to_target, s.local.data(), s.remote, threads, batch, block,
                      write);
        return DriveBandwidth(m, threads, batch, block, "engine");
      },
      [&] { return ReferenceBandwidth(s, threads, batch, block, write); },
      [](const BwResult& r) { return r.gb_s(); });
}

void PrintBw(const Session& s, bool write, uint32_t batch, int threads, const BwPair& pair) {
  const std::string transport = s.initiator->detection().transport;
  const BwResult& r = pair.engine;
  const std::optional<BwResult>& ref = pair.ref;
  const double ratio = pair.ratio;
  const char* layout = absl::GetFlag(FLAGS_scatter) ? "scattered" : "adjacent";
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"mode\": \"bw\", \"op\": \"%s\", \"transport\": \"%s\", \"block\": %llu, "
        "\"layout\": \"%s\", "
        "\"batch\": %u, \"threads\": %d, \"requests\": %.0f, \"seconds\": %.6f, "
        "\"mib_per_s\": %.3f, \"gb_per_s\": %.6f, \"ops_per_s\": %.1f, "
        "\"batch_us_p50\": %.2f, \"batch_us_p99\": %.2f, \"batch_us_p999\": %.2f, "
        "\"reference\": \"%s\", \"reference_gb_per_s\": %.6f, \"ratio\": %.4f, \"rounds\": %u}\n",
        OpName(write).c_str(), transport.c_str(), static_cast<unsigned long long>(r.block), layout,
        batch, threads, r.requests, r.seconds, r.mib_s(), r.gb_s(), r.ops_s(), r.batch_us.p50,
        r.batch_us.p99, r.batch_us.p999, s.reference.c_str(), ref ? ref->gb_s() : 0.0, ratio,
        std::max<uint32_t>(1, absl::GetFlag(FLAGS_rounds)));
    return;
  }
  std::printf(
      "%s %llu B x %.0f, %s, over %s (%d link(s)), %d thread(s): %.2f MiB/s (%.3f GB/s), "
      "%.0f ops/s; batch of %u: p50 %.1f us, p99 %.1f us, p999 %.1f us\n",
      write ? "WRITE" : "READ", static_cast<unsigned long long>(r.block), r.requests, layout,
      transport.c_str(), EngineLinks(s), threads, r.mib_s(), r.gb_s(), r.ops_s(), batch,
      r.batch_us.p50, r.batch_us.p99, r.batch_us.p999);
  if (ref) {
    std::printf("  reference %s: %.3f GB/s, %.0f ops/s; ratio engine/%s %.2f%s\n",
                s.reference.c_str(), ref->gb_s(), ref->ops_s(), s.reference.c_str(), ratio,
                RoundsNote().c_str());
  }
  std::printf("RESULT mode=bw op=%s block=%llu layout=%s value=%.3f unit=MiB/s%s\n",
              OpName(write).c_str(), static_cast<unsigned long long>(r.block), layout, r.mib_s(),
              ref ? absl::StrFormat(" reference=%s ratio=%.4f", s.reference, ratio).c_str() : "");
}

using LatPair = Paired<LatResult>;

absl::StatusOr<std::optional<LatResult>> RefLat(Session& s, uint64_t block);

absl::StatusOr<LatPair> MeasureLat(Session& s, uint64_t block) {
  return Alternate<LatResult>([&] { return EngineLatency(s, block); },
                              [&] { return RefLat(s, block); },
                              [](const LatResult& r) { return r.one_way_us.p50; });
}

void PrintLat(const Session& s, uint64_t block, const LatPair& pair) {
  const std::string transport = s.initiator->detection().transport;
  const LatResult& r = pair.engine;
  const std::optional<LatResult>& ref = pair.ref;
  const double ratio = pair.ratio;
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"mode\": \"lat\", \"op\": \"write\", \"transport\": \"%s\", \"block\": %llu, "
        "\"round_trips\": %zu, \"one_way_us_p50\": %.3f, \"one_way_us_p99\": %.3f, "
        "\"one_way_us_p999\": %.3f, \"reference\": \"%s\", "
        "\"reference_one_way_us_p50\": %.3f, \"ratio\": %.4f, \"rounds\": %u}\n",
        transport.c_str(), static_cast<unsigned long long>(block), r.rounds, r.one_way_us.p50,
        r.one_way_us.p99, r.one_way_us.p999, s.reference.c_str(), ref ? ref->one_way_us.p50 : 0.0,
        ratio, std::max<uint32_t>(1, absl::GetFlag(FLAGS_rounds)));
    return;
  }
  std::printf(
      "WRITE %llu B ping-pong%s x %zu over %s: one-way median %.2f us, p99 %.2f us, "
      "p999 %.2f us\n",
      static_cast<unsigned long long>(block),
      absl::GetFlag(FLAGS_prepared) ? " (prepared transfers)" : "", r.rounds, transport.c_str(),
      r.one_way_us.p50, r.one_way_us.p99, r.one_way_us.p999);
  if (ref) {
    std::printf("  reference %s: median %.2f us; ratio engine/%s %.2f%s\n", s.reference.c_str(),
                ref->one_way_us.p50, s.reference.c_str(), ratio, RoundsNote().c_str());
  }
  std::printf("RESULT mode=lat op=write block=%llu value=%.3f unit=us%s\n",
              static_cast<unsigned long long>(block), r.one_way_us.p50,
              ref ? absl::StrFormat(" reference=%s ratio=%.4f", s.reference, ratio).c_str() : "");
}

absl::StatusOr<std::optional<LatResult>> RefLat(Session& s, uint64_t block) {
  if (s.reference == "none") return std::optional<LatResult>();
  // Its echo lands past the engine's ping-pong buffers (local + block is
  // where the peer's WRITEs land): the two never share bytes (the arena
  // holds three blocks).
  char* a = s.local.data();
  char* b = s.local.data() + 2 * block;
  ASSIGN_OR_RETURN(LatResult r, ReferenceLatency(s.reference, a, b, block, s.sink_address));
  return std::optional<LatResult>(r);
}

// A path given on the command line, relative to where `bazel run` was run.
std::string UserPath(const std::string& p) {
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
  if (p.empty() || p[0] == '/' || wd == nullptr) return p;
  return absl::StrCat(wd, "/", p);
}

int Sweep(Session& s, const std::vector<uint64_t>& blocks, bool write, uint32_t batch,
          int threads) {
  const std::string out = UserPath(absl::GetFlag(FLAGS_out));
  const std::string csv = out + ".csv", png = out + ".png", gp = out + ".gp";
  FILE* f = std::fopen(csv.c_str(), "w");
  if (f == nullptr) Die(absl::InvalidArgumentError(absl::StrCat("cannot write ", csv)));
  std::fprintf(f,
               "block_bytes,engine_gb_per_s,reference_gb_per_s,bw_ratio,engine_ops_per_s,"
               "engine_batch_us_p50,engine_lat_us_p50,engine_lat_us_p99,reference_lat_us_p50,"
               "lat_ratio\n");
  for (uint64_t block : blocks) {
    auto bw = MeasureBw(s, threads, batch, block, write);
    if (!bw.ok()) Die(bw.status());
    PrintBw(s, write, batch, threads, *bw);
    auto lat = MeasureLat(s, block);
    if (!lat.ok()) Die(lat.status());
    PrintLat(s, block, *lat);
    std::fprintf(f, "%llu,%.6f,%.6f,%.4f,%.1f,%.2f,%.3f,%.3f,%.3f,%.4f\n",
                 static_cast<unsigned long long>(block), bw->engine.gb_s(),
                 bw->ref ? bw->ref->gb_s() : 0.0, bw->ratio, bw->engine.ops_s(),
                 bw->engine.batch_us.p50, lat->engine.one_way_us.p50, lat->engine.one_way_us.p99,
                 lat->ref ? lat->ref->one_way_us.p50 : 0.0, lat->ratio);
    std::fflush(f);
  }
  std::fclose(f);
  std::printf("sweep: wrote %s\n", csv.c_str());
  // The chart: throughput and latency against block size, engine and
  // reference side by side.
  FILE* g = std::fopen(gp.c_str(), "w");
  if (g == nullptr) Die(absl::InvalidArgumentError(absl::StrCat("cannot write ", gp)));
  const std::string transport = s.initiator->detection().transport;
  const bool ref = s.reference != "none";
  std::fprintf(g,
               "set terminal pngcairo size 1200,500 noenhanced\n"
               "set output '%s'\n"
               "set datafile separator ','\n"
               "set key top left\n"
               "set logscale x 2\n"
               "set format x '%%.0b %%BB'\n"
               "set grid\n"
               "set xlabel 'block (bytes)'\n"
               "set multiplot layout 1,2 title 'kvferry transfer_bench: %s %s, batch %u, %d "
               "thread(s), reference %s'\n"
               "set ylabel 'GB/s'\n"
               "plot '%s' using 1:2 skip 1 with linespoints title 'kvferry'%s\n"
               "set logscale y\n"
               "set ylabel 'one-way latency p50 (us)'\n"
               "plot '%s' using 1:7 skip 1 with linespoints title 'kvferry'%s\n"
               "unset multiplot\n",
               png.c_str(), OpName(write).c_str(), transport.c_str(), batch, threads,
               s.reference.c_str(), csv.c_str(),
               ref ? absl::StrCat(", '", csv, "' using 1:3 skip 1 with linespoints title '",
                                  s.reference, "'")
                         .c_str()
                   : "",
               csv.c_str(),
               ref ? absl::StrCat(", '", csv, "' using 1:9 skip 1 with linespoints title '",
                                  s.reference, "'")
                         .c_str()
                   : "");
  std::fclose(g);
  const std::string cmd = absl::StrCat("gnuplot '", gp, "' 2>&1");
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr,
                 "transfer_bench: gnuplot not found (apt-get install gnuplot-nox); "
                 "the chart script is %s\n",
                 gp.c_str());
    return 1;
  }
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "transfer_bench: gnuplot failed on %s\n", gp.c_str());
    return 1;
  }
  std::printf("sweep: wrote %s\n", png.c_str());
  return 0;
}

// ----------------------------------------------------------------- prepared

struct PreparedRow {
  uint64_t block = 0, batch = 0, descriptors = 0;
  double gb_s = 0, lat_us = 0;
  double ref_gb_s = 0;  // 0: no reference
  double prep_avg = 0, prep_p99 = 0, post_avg = 0, post_p99 = 0, tx_avg = 0, tx_p99 = 0;
};

double Average(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / v.size();
}

// One (block, batch) point of the --prepared sweep.
absl::StatusOr<PreparedRow> MeasurePrepared(Session& s, uint64_t block, uint64_t batch,
                                            bool write) {
  PreparedTransfers& p = s.initiator->prepared();
  const uint64_t stride = BwStride(block);
  std::vector<Descriptor> mine, theirs;
  std::vector<int64_t> idx;
  for (uint64_t j = 0; j < batch; ++j) {
    mine.push_back({reinterpret_cast<uintptr_t>(s.local.data()) + j * stride, block});
    theirs.push_back({s.remote + j * stride, block});
    idx.push_back(static_cast<int64_t>(j));
  }
  const Opcode op = write ? Opcode::kWrite : Opcode::kRead;
  std::vector<double> prep;
  for (int r = 0; r < 20; ++r) {  // prepare and make, timed apart
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(uint64_t l, p.PrepareLocal(mine));
    ASSIGN_OR_RETURN(uint64_t rl, p.PrepareRemote(s.to_target, theirs));
    ASSIGN_OR_RETURN(uint64_t x, p.Make(op, l, idx, rl, idx));
    prep.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    (void)p.Release(x);
    (void)p.ReleaseList(l);
    (void)p.ReleaseList(rl);
  }
  ASSIGN_OR_RETURN(uint64_t local, p.PrepareLocal(mine));
  ASSIGN_OR_RETURN(uint64_t remote, p.PrepareRemote(s.to_target, theirs));
  ASSIGN_OR_RETURN(uint64_t x, p.Make(op, local, idx, remote, idx));
  std::vector<double> post, tx;
  auto once = [&](bool timed) -> absl::Status {
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(XferState st, p.Post(x));
    const absl::Time posted = absl::Now();
    while (st == XferState::kInProgress) {
      ASSIGN_OR_RETURN(st, p.State(x));
    }
    if (timed) {
      post.push_back(absl::ToDoubleMicroseconds(posted - start));
      tx.push_back(absl::ToDoubleMicroseconds(absl::Now() - posted));
    }
    return absl::OkStatus();
  };
  for (uint64_t i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) RETURN_IF_ERROR(once(false));
  const uint64_t iters = std::max<uint64_t>(1, absl::GetFlag(FLAGS_iters));
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < iters; ++i) RETURN_IF_ERROR(once(true));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  ASSIGN_OR_RETURN(XferTelemetry t, p.Telemetry(x));
  (void)p.Release(x);
  (void)p.ReleaseList(local);
  (void)p.ReleaseList(remote);
  PreparedRow row;
  if (s.reference != "none") {
    // The same bytes over the same connections (or memcpy), as many blocks
    // in flight: two batches of half as many.
    const uint64_t saved = absl::GetFlag(FLAGS_iters);
    absl::SetFlag(&FLAGS_iters, iters * batch);
    absl::StatusOr<std::optional<BwResult>> ref = ReferenceBandwidth(
        s, 1, static_cast<uint32_t>(std::max<uint64_t>(1, batch / 2)), block, write);
    absl::SetFlag(&FLAGS_iters, saved);
    RETURN_IF_ERROR(ref.status());
    if (ref->has_value()) row.ref_gb_s = (*ref)->gb_s();
  }
  row.block = block;
  row.batch = batch;
  row.descriptors = t.descriptors;
  row.gb_s = double(block) * batch * iters / seconds / 1e9;
  row.lat_us = seconds * 1e6 / (double(iters) * batch);
  row.prep_avg = Average(prep);
  row.prep_p99 = Summarize(prep).p99;
  row.post_avg = Average(post);
  row.post_p99 = Summarize(post).p99;
  row.tx_avg = Average(tx);
  row.tx_p99 = Summarize(tx).p99;
  return row;
}

int PreparedSweep(Session& s, const std::vector<uint64_t>& blocks,
                  const std::vector<uint64_t>& batches, bool write) {
  const std::string transport = s.initiator->detection().transport;
  const bool json = absl::GetFlag(FLAGS_json);
  const char* layout = absl::GetFlag(FLAGS_scatter) ? "scattered" : "adjacent";
  if (!json) {
    std::printf(
        "prepared %s over %s, %s blocks (nixlbench's columns; descriptors after "
        "merging)\n",
        OpName(write).c_str(), transport.c_str(), layout);
    std::printf("%-14s %-10s %-6s %-12s %-13s %-13s %-13s %-13s %-13s %-11s %-11s %-12s %s\n",
                "Block Size (B)", "Batch Size", "Descs", "B/W (GB/Sec)", "Avg Lat. (us)",
                "Avg Prep (us)", "P99 Prep (us)", "Avg Post (us)", "P99 Post (us)", "Avg Tx (us)",
                "P99 Tx (us)", absl::StrCat(s.reference, " GB/s").c_str(), "Ratio");
  }
  PreparedRow last;
  for (uint64_t block : blocks) {
    for (uint64_t batch : batches) {
      if (batch * BwStride(block) > s.remote_len || batch * BwStride(block) > s.local.size()) {
        std::fprintf(stderr, "transfer_bench: %llu x %llu B does not fit the buffers; skipped\n",
                     static_cast<unsigned long long>(batch),
                     static_cast<unsigned long long>(block));
        continue;
      }
      absl::StatusOr<PreparedRow> r = MeasurePrepared(s, block, batch, write);
      if (!r.ok()) Die(r.status());
      if (json) {
        std::printf(
            "{\"mode\": \"prepared\", \"op\": \"%s\", \"transport\": \"%s\", "
            "\"layout\": \"%s\", \"block\": %llu, \"batch\": %llu, "
            "\"descriptors\": %llu, \"gb_s\": %.4f, \"lat_us\": %.3f, "
            "\"prep_us\": %.2f, \"prep_p99_us\": %.2f, \"post_us\": %.2f, "
            "\"post_p99_us\": %.2f, \"tx_us\": %.2f, \"tx_p99_us\": %.2f, "
            "\"reference\": \"%s\", \"reference_gb_s\": %.4f, \"ratio\": %.4f}\n",
            OpName(write).c_str(), transport.c_str(), layout,
            static_cast<unsigned long long>(block), static_cast<unsigned long long>(batch),
            static_cast<unsigned long long>(r->descriptors), r->gb_s, r->lat_us, r->prep_avg,
            r->prep_p99, r->post_avg, r->post_p99, r->tx_avg, r->tx_p99, s.reference.c_str(),
            r->ref_gb_s, r->ref_gb_s > 0 ? r->gb_s / r->ref_gb_s : 0.0);
      } else {
        std::printf(
            "%-14llu %-10llu %-6llu %-12.3f %-13.3f %-13.1f %-13.1f %-13.2f %-13.2f "
            "%-11.1f %-11.1f %-12.3f %.3f\n",
            static_cast<unsigned long long>(block), static_cast<unsigned long long>(batch),
            static_cast<unsigned long long>(r->descriptors), r->gb_s, r->lat_us, r->prep_avg,
            r->prep_p99, r->post_avg, r->post_p99, r->tx_avg, r->tx_p99, r->ref_gb_s,
            r->ref_gb_s > 0 ? r->gb_s / r->ref_gb_s : 0.0);
      }
      std::fflush(stdout);
      last = *r;
    }
  }
  // For scripts (tools/softroce/bench.sh): the last row's rate.
  if (!json) {
    std::printf(
        "RESULT mode=prepared block=%llu batch=%llu value=%.3f unit=MiB/s reference=%s "
        "ratio=%.4f\n",
        static_cast<unsigned long long>(last.block), static_cast<unsigned long long>(last.batch),
        last.gb_s * 1e9 / (1 << 20), s.reference.c_str(),
        last.ref_gb_s > 0 ? last.gb_s / last.ref_gb_s : 0.0);
  }
  return 0;
}

// A comma-separated list of positive counts given to flag `flag` (what
// each is: `unit`); "default" names 4 KiB..4 MiB block sizes for --sweep.
absl::StatusOr<std::vector<uint64_t>> ParseCounts(const std::string& list, const char* flag,
                                                  const char* unit) {
  std::vector<uint64_t> out;
  if (list == "default" && std::string(flag) == "--sweep") {
    for (uint64_t b = 4096; b <= (4 << 20); b *= 4) out.push_back(b);
    return out;
  }
  for (absl::string_view w : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    uint64_t b;
    if (!absl::SimpleAtoi(w, &b) || b == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", std::string(w), "\" is not ", unit));
    }
    out.push_back(b);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " names none"));
  return out;
}

int Main() {
  const std::string role = absl::GetFlag(FLAGS_role);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string op = absl::GetFlag(FLAGS_op);
  if (role != "loopback" && role != "target" && role != "initiator") {
    std::fprintf(stderr,
                 "transfer_bench: --role must be loopback, target or initiator, not \"%s\"\n",
                 role.c_str());
    return 2;
  }
  if (mode != "bw" && mode != "lat" && mode != "layers") {
    std::fprintf(stderr, "transfer_bench: --mode must be bw, lat or layers, not \"%s\"\n",
                 mode.c_str());
    return 2;
  }
  if (op != "write" && op != "read") {
    std::fprintf(stderr, "transfer_bench: --op must be write or read, not \"%s\"\n", op.c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_transport) == "sim") {
    std::fprintf(stderr,
                 "transfer_bench: the simulated transport runs inside the simulator, in simulated "
                 "time: use //bench:scale_benchmark (striping, memory) or //tools:simulate (one "
                 "transfer over a modelled link)\n");
    return 2;
  }
  if (role == "target") return ServeTarget();
  const int threads = static_cast<int>(absl::GetFlag(FLAGS_threads));
  const uint32_t batch = absl::GetFlag(FLAGS_batch);
  if (threads < 1 || threads > 64 || batch < 1) {
    std::fprintf(stderr, "transfer_bench: --threads must be 1..64 and --batch at least 1\n");
    return 2;
  }
  std::vector<uint64_t> blocks = {std::max<uint64_t>(1, absl::GetFlag(FLAGS_block))};
  const std::string sweep = absl::GetFlag(FLAGS_sweep);
  if (!sweep.empty()) {
    auto b = ParseCounts(sweep, "--sweep", "a block size in bytes");
    if (!b.ok()) {
      std::fprintf(stderr, "transfer_bench: %s\n", std::string(b.status().message()).c_str());
      return 2;
    }
    blocks = *b;
    // A second per measure unless told otherwise.
    if (absl::GetFlag(FLAGS_duration) <= 0 && absl::GetFlag(FLAGS_bytes) == 0) {
      absl::SetFlag(&FLAGS_duration, 1.0);
    }
  }
  std::vector<uint64_t> batches;
  if (absl::GetFlag(FLAGS_prepared) && mode != "lat") {
    auto b = ParseCounts(absl::GetFlag(FLAGS_batches), "--batches", "a batch size");
    if (!b.ok()) {
      std::fprintf(stderr, "transfer_bench: %s\n", std::string(b.status().message()).c_str());
      return 2;
    }
    batches = *b;
  }
  Session s;
  // The prepared sweep's largest batch of blocks (two halves' worth: the
  // buffers OpenSession sizes hold two batches per thread).
  const uint32_t sized_batch =
      batches.empty()
          ? batch
          : static_cast<uint32_t>((*std::max_element(batches.begin(), batches.end()) + 1) / 2);
  absl::Status st =
      OpenSession(s, role, *std::max_element(blocks.begin(), blocks.end()), threads, sized_batch);
  if (!st.ok()) Die(st);
  const bool write = op == "write";
  int rc = 0;
  if (!batches.empty()) {
    rc = PreparedSweep(s, blocks, batches, write);
  } else if (!sweep.empty()) {
    rc = Sweep(s, blocks, write, batch, threads);
  } else if (mode == "layers") {
    rc = MeasureLayers(s, threads, batch, blocks[0]);
  } else if (mode == "bw") {
    auto r = MeasureBw(s, threads, batch, blocks[0], write);
    if (!r.ok()) Die(r.status());
    PrintBw(s, write, batch, threads, *r);
  } else {
    auto r = MeasureLat(s, blocks[0]);
    if (!r.ok()) Die(r.status());
    PrintLat(s, blocks[0], *r);
  }
  if (role == "initiator") (void)s.initiator->Notify(s.to_target, "done");
  return rc;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the engine's throughput (--mode=bw) or ping-pong latency (--mode=lat), each beside a\n"
      "reference measured in the same run (memcpy, a raw socket stream).\n"
      "  ./bazelw run -c opt //bench:transfer_bench                     # loopback, bw\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --mode=lat --block=8\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --mode=layers --threads=4 --block=2048\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --role=target --port=16000\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --role=initiator --peer=HOST:16000\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --sweep=default --out=/tmp/sweep");
  absl::ParseCommandLine(argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  if (!absl::GetFlag(FLAGS_verbose)) kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  return kvferry::Main();
}
