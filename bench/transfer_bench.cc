// transfer_bench: the engine's own throughput and latency, the figures to
// hold against perftest (ib_write_bw / ib_write_lat) and ucx_perftest on
// the same device.
//
//   ./bazelw run -c opt //bench:transfer_bench -- --mode=bw --block=65536
//   ./bazelw run -c opt //bench:transfer_bench -- --mode=lat --block=8
//
// Two engines in one process (an initiator and a target, over loopback or
// the local RDMA device), found by host:port like any peers.
//   bw:  WRITE (or READ) `block`-byte requests, `depth` per batch, two
//        batches in flight, for `iters` requests; prints MiB/s (2^20 bytes,
//        as perftest does) and messages/s.
//   lat: ping-pong like ib_write_lat: the initiator WRITEs `block` bytes to
//        the target, the target sees them land and WRITEs them back; half
//        the round trip is the one-way latency. Prints median, p99, p999
//        in microseconds.
// The last line is machine-readable: "RESULT mode=... value=..."; --json prints
// one JSON object instead (throughput, ops/s, latency percentiles).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/transfer_engine.h"

ABSL_FLAG(std::string, mode, "bw", "bw (throughput) or lat (ping-pong latency)");
ABSL_FLAG(std::string, op, "write", "bw mode: write or read");
ABSL_FLAG(std::string, transport, "auto", "auto, tcp or rdma");
ABSL_FLAG(std::string, host, "127.0.0.1", "address both engines use");
ABSL_FLAG(uint64_t, block, 64 << 10, "bytes per request");
ABSL_FLAG(uint32_t, depth, 64, "bw mode: requests per batch (two batches in flight)");
ABSL_FLAG(uint64_t, iters, 2000, "requests (bw) or round trips (lat) measured");
ABSL_FLAG(uint64_t, warmup, 100, "requests or round trips before measuring");
ABSL_FLAG(bool, verbose, false, "engine logs at INFO");
ABSL_FLAG(bool, json, false, "print the result as one JSON object instead of text");

namespace kvferry {
namespace {

using transport::Opcode;

struct Pair {
  std::unique_ptr<TransferEngine> initiator, target;
  SegmentId to_target = 0, to_initiator = 0;
};

absl::StatusOr<Pair> MakePair() {
  EngineOptions o;
  o.local_host = absl::GetFlag(FLAGS_host);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.slice_bytes = std::max<uint64_t>(o.slice_bytes, absl::GetFlag(FLAGS_block));
  Pair p;
  ASSIGN_OR_RETURN(p.initiator, TransferEngine::Create(o));
  ASSIGN_OR_RETURN(p.target, TransferEngine::Create(o));
  return p;
}

absl::Status Open(Pair& p) {
  ASSIGN_OR_RETURN(p.to_target, p.initiator->OpenSegment(p.target->address()));
  ASSIGN_OR_RETURN(p.to_initiator, p.target->OpenSegment(p.initiator->address()));
  return absl::OkStatus();
}

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

absl::Status Finish(TransferEngine& e, BatchId b) {
  ASSIGN_OR_RETURN(BatchStatus s, e.Wait(b, absl::Seconds(60)));
  if (!s.ok()) {
    return s.done() ? s.requests[0] : absl::DeadlineExceededError("batch did not finish in 60 s");
  }
  return e.Release(b);
}

int Bandwidth() {
  const uint64_t block = absl::GetFlag(FLAGS_block);
  const uint32_t depth = std::max<uint32_t>(1, absl::GetFlag(FLAGS_depth));
  const bool write = absl::GetFlag(FLAGS_op) == "write";
  if (!write && absl::GetFlag(FLAGS_op) != "read") {
    std::fprintf(stderr, "transfer_bench: --op must be write or read\n");
    return 2;
  }
  auto pair = MakePair();
  if (!pair.ok()) {
    std::fprintf(stderr, "transfer_bench: %s\n", std::string(pair.status().message()).c_str());
    return 1;
  }
  Pair& p = *pair;
  // Two batches in flight, each on its own part of both buffers.
  std::vector<char> src(2 * depth * block, 'x'), dst(2 * depth * block, 0);
  absl::Status st = p.initiator->RegisterMemory(src.data(), src.size());
  if (st.ok()) st = p.target->RegisterMemory(dst.data(), dst.size());
  if (st.ok()) st = Open(p);
  std::vector<TransferRequest> batch[2];
  for (int half = 0; half < 2; ++half) {
    for (uint32_t i = 0; i < depth; ++i) {
      const uint64_t off = (half * depth + i) * block;
      batch[half].push_back({write ? Opcode::kWrite : Opcode::kRead, src.data() + off,
                             reinterpret_cast<uintptr_t>(dst.data()) + off, block});
    }
  }
  const uint64_t warm_batches = (absl::GetFlag(FLAGS_warmup) + depth - 1) / depth;
  const uint64_t batches = std::max<uint64_t>(1, (absl::GetFlag(FLAGS_iters) + depth - 1) / depth);
  absl::Time start;
  BatchId inflight[2] = {0, 0};
  absl::Time submitted[2];
  bool busy[2] = {false, false};
  std::vector<double> batch_us;  // Submit to done, measured batches only
  auto finish = [&](int h) {
    absl::Status s = Finish(*p.initiator, inflight[h]);
    if (s.ok() && start != absl::Time()) {
      batch_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - submitted[h]));
    }
    busy[h] = false;
    return s;
  };
  for (uint64_t n = 0; st.ok() && n < warm_batches + batches; ++n) {
    if (n == warm_batches) {
      // Measure from an empty pipe.
      for (int h = 0; h < 2 && st.ok(); ++h) {
        if (busy[h]) st = finish(h);
      }
      start = absl::Now();
    }
    const int h = n % 2;
    if (busy[h] && st.ok()) st = finish(h);
    if (!st.ok()) break;
    submitted[h] = absl::Now();
    absl::StatusOr<BatchId> b = p.initiator->Submit(p.to_target, batch[h]);
    if (!b.ok()) st = b.status();
    else inflight[h] = *b, busy[h] = true;
  }
  for (int h = 0; h < 2 && st.ok(); ++h) {
    if (busy[h]) st = finish(h);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "transfer_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double requests = static_cast<double>(batches) * depth;
  const double mib_s = requests * block / seconds / (1 << 20);
  const Percentiles lat = Summarize(batch_us);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"mode\": \"bw\", \"op\": \"%s\", \"transport\": \"%s\", \"block\": %llu, "
                "\"depth\": %u, \"requests\": %.0f, \"seconds\": %.6f, \"mib_per_s\": %.3f, "
                "\"gb_per_s\": %.6f, \"ops_per_s\": %.1f, \"batch_us_p50\": %.2f, "
                "\"batch_us_p99\": %.2f, \"batch_us_p999\": %.2f}\n",
                write ? "write" : "read", p.initiator->detection().transport.c_str(),
                static_cast<unsigned long long>(block), depth, requests, seconds, mib_s,
                requests * block / seconds / 1e9, requests / seconds, lat.p50, lat.p99, lat.p999);
    return 0;
  }
  std::printf("%s %llu B x %.0f over %s: %.2f MiB/s (%.3f GB/s), %.0f ops/s; batch of %u: "
              "p50 %.1f us, p99 %.1f us, p999 %.1f us\n",
              write ? "WRITE" : "READ", static_cast<unsigned long long>(block), requests,
              p.initiator->detection().transport.c_str(), mib_s, requests * block / seconds / 1e9,
              requests / seconds, depth, lat.p50, lat.p99, lat.p999);
  std::printf("RESULT mode=bw op=%s block=%llu value=%.3f unit=MiB/s\n", write ? "write" : "read",
              static_cast<unsigned long long>(block), mib_s);
  return 0;
}

// Reads a byte the transport writes behind our back (the NIC's DMA, or
// the TCP transport's recv), as perftest's latency tests do. Not a
// synchronisation ThreadSanitizer can see, so not instrumented.
__attribute__((no_sanitize("thread"))) char Peek(const char* p) {
  return *reinterpret_cast<const volatile char*>(p);
}

int Latency() {
  const uint64_t block = std::max<uint64_t>(1, absl::GetFlag(FLAGS_block));
  auto pair = MakePair();
  if (!pair.ok()) {
    std::fprintf(stderr, "transfer_bench: %s\n", std::string(pair.status().message()).c_str());
    return 1;
  }
  Pair& p = *pair;
  // Each side: a send buffer and a receive buffer whose last byte carries
  // the round number (like perftest, the last byte lands last).
  // The target echoes from two send buffers in turn: a buffer is written
  // again only after the write that used it has completed.
  std::vector<char> isend(block, 0), irecv(block, 0), trecv(block, 0);
  std::vector<char> tsend[2] = {std::vector<char>(block, 0), std::vector<char>(block, 0)};
  absl::Status st = p.initiator->RegisterMemory(isend.data(), block);
  if (st.ok()) st = p.initiator->RegisterMemory(irecv.data(), block);
  if (st.ok()) st = p.target->RegisterMemory(tsend[0].data(), block);
  if (st.ok()) st = p.target->RegisterMemory(tsend[1].data(), block);
  if (st.ok()) st = p.target->RegisterMemory(trecv.data(), block);
  if (st.ok()) st = Open(p);
  if (!st.ok()) {
    std::fprintf(stderr, "transfer_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  const uint64_t warmup = absl::GetFlag(FLAGS_warmup);
  const uint64_t rounds = warmup + std::max<uint64_t>(1, absl::GetFlag(FLAGS_iters));
  auto wait_for = [](const char* last, char want, std::atomic<bool>& failed) {
    while (Peek(last) != want) {
      if (failed.load(std::memory_order_relaxed)) return false;
    }
    return true;
  };
  std::atomic<bool> failed{false};
  std::string error;
  // The target echoes every round back.
  // Like ib_write_lat, neither side blocks on its write's completion before
  // waiting for the next message: each finishes the previous round's batch
  // once the next message is in (by then it has long completed).
  std::thread echo([&] {
    BatchId previous = 0;
    for (uint64_t r = 1; r <= rounds; ++r) {
      const char mark = static_cast<char>(r % 251 + 1);
      if (!wait_for(&trecv[block - 1], mark, failed)) return;
      std::vector<char>& out = tsend[r % 2];
      out[block - 1] = mark;
      TransferRequest w{Opcode::kWrite, out.data(), reinterpret_cast<uintptr_t>(irecv.data()),
                        block};
      absl::StatusOr<BatchId> b = p.target->Submit(p.to_initiator, {&w, 1});
      absl::Status s = b.status();
      if (s.ok() && previous != 0) s = Finish(*p.target, previous);
      if (s.ok()) previous = *b;
      if (s.ok() && r == rounds) s = Finish(*p.target, previous);
      if (!s.ok()) {
        error = s.ToString();
        failed = true;
        return;
      }
    }
  });
  std::vector<double> half_rtt_us;
  half_rtt_us.reserve(rounds);
  for (uint64_t r = 1; r <= rounds && !failed; ++r) {
    const char mark = static_cast<char>(r % 251 + 1);
    isend[block - 1] = mark;
    const absl::Time t0 = absl::Now();
    TransferRequest w{Opcode::kWrite, isend.data(), reinterpret_cast<uintptr_t>(trecv.data()),
                      block};
    absl::StatusOr<BatchId> b = p.initiator->Submit(p.to_target, {&w, 1});
    if (!b.ok()) {
      error = b.status().ToString();
      failed = true;
      break;
    }
    const bool echoed = wait_for(&irecv[block - 1], mark, failed);
    const absl::Time t1 = absl::Now();
    absl::Status s = echoed ? Finish(*p.initiator, *b) : absl::OkStatus();
    if (!echoed || !s.ok()) {
      if (!s.ok()) error = s.ToString();
      failed = true;
      break;
    }
    if (r > warmup) half_rtt_us.push_back(absl::ToDoubleMicroseconds(t1 - t0) / 2);
  }
  echo.join();
  if (failed) {
    std::fprintf(stderr, "transfer_bench: %s\n", error.c_str());
    return 1;
  }
  const Percentiles lat = Summarize(half_rtt_us);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"mode\": \"lat\", \"op\": \"write\", \"transport\": \"%s\", \"block\": %llu, "
                "\"round_trips\": %zu, \"one_way_us_p50\": %.3f, \"one_way_us_p99\": %.3f, "
                "\"one_way_us_p999\": %.3f}\n",
                p.initiator->detection().transport.c_str(), static_cast<unsigned long long>(block),
                half_rtt_us.size(), lat.p50, lat.p99, lat.p999);
    return 0;
  }
  std::printf("WRITE %llu B ping-pong x %zu over %s: one-way median %.2f us, p99 %.2f us, "
              "p999 %.2f us\n",
              static_cast<unsigned long long>(block), half_rtt_us.size(),
              p.initiator->detection().transport.c_str(), lat.p50, lat.p99, lat.p999);
  std::printf("RESULT mode=lat op=write block=%llu value=%.3f unit=us\n",
              static_cast<unsigned long long>(block), lat.p50);
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "measures the engine's throughput (--mode=bw) or ping-pong latency (--mode=lat)\n"
      "between two engines in this process.\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --mode=bw --block=65536\n"
      "  ./bazelw run -c opt //bench:transfer_bench -- --mode=lat --block=8");
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_verbose)) kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "bw") return kvferry::Bandwidth();
  if (mode == "lat") return kvferry::Latency();
  std::fprintf(stderr, "transfer_bench: --mode must be bw or lat, not \"%s\"\n", mode.c_str());
  return 2;
}
