// Scale figures in the deterministic simulator, each against its reference
// in the same run:
//   * 8 x 400 Gb/s: a host with 8 NICs and 8 GPUs (GPU i next to NIC i)
//     WRITEs to an identical host; the aggregate rate the engine's striping
//     reaches, against the sum of the link rates, with buffers on every GPU
//     at once and on one GPU alone. Time is simulated (the fabric's link
//     model), so the figure is the engine's scheduling, not this machine.
//   * 1,000 open peers: the heap memory in use (glibc's mallinfo2, exact
//     to the byte, unlike RSS whose pages malloc reuses) that one engine
//     opening segments to 1,000 simulated peers adds: its descriptors,
//     links and metrics, and the peers' accepted links (so an upper bound
//     on the engine's share); plus what one idle engine holds, measured as
//     the average over the 1,001 engines the process starts. The simulated
//     transport's buffers are the stand-in for a NIC's queues.
//
//   ./bazelw run -c opt //bench:scale_benchmark [-- --peers=1000 --mib_per_gpu=64]
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/testing/sim_world.h"
#include "engine/transfer_engine.h"

ABSL_FLAG(int, gpus, 8, "GPUs and NICs per host");
ABSL_FLAG(double, gbps, 400, "each NIC's link rate, Gb/s");
ABSL_FLAG(uint64_t, mib_per_gpu, 64, "MiB written from each GPU's buffer");
ABSL_FLAG(int, peers, 1000, "peers for the memory figure");

namespace kvferry {
namespace {

using transport::Opcode;

// Heap bytes in use in this process (small blocks and mmapped ones).
uint64_t HeapInUse() {
  const struct mallinfo2 m = ::mallinfo2();
  return m.uordblks + m.hblkhd;
}

// Resident set size of this process, bytes.
uint64_t Rss() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// Ends the run, saying why, when a step of the setup or the transfer fails.
void Must(const absl::Status& s, const std::string& what) {
  if (s.ok()) return;
  std::fprintf(stderr, "scale_benchmark: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}
template <typename T>
T Must(absl::StatusOr<T> v, const std::string& what) {
  Must(v.status(), what);
  return std::move(*v);
}
// A batch that did not succeed, as a status.
absl::Status BatchResult(const absl::StatusOr<BatchStatus>& st) {
  if (!st.ok()) return st.status();
  for (const absl::Status& r : st->requests) RETURN_IF_ERROR(r);
  return absl::OkStatus();
}

struct StripeResult {
  double seconds = 0;  // simulated
  uint64_t bytes = 0;
  std::vector<uint64_t> nic_bytes;
};

// Writes `mib` MiB from each GPU in `sources` ("cuda:N" buffers) to the
// peer, one batch per GPU, all in flight at once.
StripeResult Stripe(const std::vector<int>& sources, uint64_t mib) {
  const int gpus = absl::GetFlag(FLAGS_gpus);
  sim::NicSpec nic;
  nic.bits_per_sec = static_cast<uint64_t>(absl::GetFlag(FLAGS_gbps) * 1e9);
  SimWorld w(2026);
  w.set_near_nics(
      [gpus](const std::string& location) -> absl::StatusOr<std::vector<transport::NicIndex>> {
        int gpu = -1;
        if (std::sscanf(location.c_str(), "cuda:%d", &gpu) != 1 || gpu < 0 || gpu >= gpus) {
          return absl::NotFoundError(absl::StrCat("no GPU ", location));
        }
        return std::vector<transport::NicIndex>{static_cast<transport::NicIndex>(gpu)};
      });
  const std::vector<int32_t> numa(gpus, 0);
  const int a = w.AddMultiNicHost(numa, nic), b = w.AddMultiNicHost(numa, nic);
  w.set_engine_options(EngineOptions{});  // the defaults: 64 KiB slices
  std::unique_ptr<TransferEngine> prefill = Must(w.StartEngine(a), "starting the sender");
  std::unique_ptr<TransferEngine> decode = Must(w.StartEngine(b), "starting the receiver");
  const uint64_t per_gpu = mib << 20;
  std::vector<std::vector<char>> src(sources.size(), std::vector<char>(per_gpu, 's'));
  std::vector<char> dst(per_gpu * sources.size(), 0);
  for (size_t i = 0; i < sources.size(); ++i) {
    Must(prefill->RegisterMemory(src[i].data(), per_gpu, transport::Access::kNone,
                                 absl::StrCat("cuda:", sources[i])),
         "registering a GPU buffer");
  }
  Must(decode->RegisterMemory(dst.data(), dst.size()), "registering the receiving buffer");
  const SegmentId seg = Must(prefill->OpenSegment(decode->address()), "opening the segment");
  // KV-sized requests: 512 KiB blocks.
  const uint64_t block = 512 << 10;
  const sim::SimTime start = w.sched().now();
  std::vector<BatchId> batches;
  for (size_t i = 0; i < sources.size(); ++i) {
    std::vector<TransferRequest> reqs;
    for (uint64_t off = 0; off < per_gpu; off += block) {
      reqs.push_back({Opcode::kWrite, src[i].data() + off,
                      reinterpret_cast<uintptr_t>(dst.data()) + i * per_gpu + off, block});
    }
    batches.push_back(Must(prefill->Submit(seg, reqs), "submitting"));
  }
  for (BatchId id : batches) Must(BatchResult(prefill->Wait(id, absl::Seconds(10))), "a batch");
  StripeResult r;
  r.seconds = static_cast<double>(w.sched().now() - start) / 1e9;
  r.bytes = per_gpu * sources.size();
  for (const NicCounters& c : prefill->GetNicCounters()) r.nic_bytes.push_back(c.bytes);
  for (size_t i = 0; i < sources.size(); ++i) {
    if (std::memcmp(src[i].data(), dst.data() + i * per_gpu, per_gpu) != 0) {
      Must(absl::DataLossError(absl::StrCat("GPU ", sources[i], "'s bytes differ")), "checking");
    }
  }
  return r;
}

void ReportStripe(const char* name, const StripeResult& r) {
  const int gpus = absl::GetFlag(FLAGS_gpus);
  const double links = gpus * absl::GetFlag(FLAGS_gbps) * 1e9 / 8;  // bytes/s
  const double rate = r.bytes / r.seconds;
  std::printf("%s: %.1f GB/s of %.1f GB/s (%d x %.0f Gb/s): ratio %.3f; per NIC (MiB):", name,
              rate / 1e9, links / 1e9, gpus, absl::GetFlag(FLAGS_gbps), rate / links);
  for (uint64_t b : r.nic_bytes) std::printf(" %llu", static_cast<unsigned long long>(b >> 20));
  std::printf("\n");
}

void PeersMemory() {
  const int peers = absl::GetFlag(FLAGS_peers);
  SimWorld w(7);
  const int hub = w.AddHost();
  std::vector<int> hosts;
  for (int i = 0; i < peers; ++i) hosts.push_back(w.AddHost());
  std::vector<char> local(1 << 20);
  std::vector<std::vector<char>> pools(peers, std::vector<char>(4096));
  const uint64_t empty = HeapInUse();
  std::unique_ptr<TransferEngine> engine = Must(w.StartEngine(hub), "starting the engine");
  Must(engine->RegisterMemory(local.data(), local.size()), "registering");
  std::vector<std::unique_ptr<TransferEngine>> others;
  others.reserve(peers);
  for (int i = 0; i < peers; ++i) {
    others.push_back(Must(w.StartEngine(hosts[i]), "starting a peer"));
    Must(others.back()->RegisterMemory(pools[i].data(), pools[i].size()), "registering a peer");
  }
  const uint64_t before = HeapInUse();
  const uint64_t rss_before = Rss();
  const double idle_engine = double(before - empty) / (peers + 1);
  for (int i = 0; i < peers; ++i) {
    const SegmentId seg = Must(engine->OpenSegment(others[i]->address()), "opening a segment");
    // One 4 KiB write each, so every link has carried a request.
    TransferRequest wr{Opcode::kWrite, local.data(), reinterpret_cast<uintptr_t>(pools[i].data()),
                       4096};
    const BatchId batch = Must(engine->Submit(seg, {&wr, 1}), "submitting");
    Must(BatchResult(engine->Wait(batch, absl::Seconds(1))), "a write to a peer");
    Must(engine->Release(batch), "releasing");
  }
  const uint64_t after = HeapInUse();
  const double open = double(after - before);
  std::printf(
      "%d open peers: heap +%.2f MiB (%.1f KiB per peer, both ends of its links); an "
      "idle engine %.1f KiB; engine with %d peers <= %.2f MiB, target 64 MiB (ratio "
      "%.3f); process RSS %.1f -> %.1f MiB with %d engines\n",
      peers, open / 1048576.0, open / 1024.0 / peers, idle_engine / 1024.0, peers,
      (open + idle_engine) / 1048576.0, (open + idle_engine) / (64.0 * 1048576.0),
      rss_before / 1048576.0, Rss() / 1048576.0, peers + 1);
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "simulated scale: 8 x 400 Gb/s striping against the sum of link rates, and the memory\n"
      "of 1,000 open peers.\n  ./bazelw run -c opt //bench:scale_benchmark");
  absl::ParseCommandLine(argc, argv);
  kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  const int gpus = absl::GetFlag(FLAGS_gpus);
  if (gpus < 1 || gpus > 64 || absl::GetFlag(FLAGS_gbps) <= 0 || absl::GetFlag(FLAGS_peers) < 1) {
    std::fprintf(stderr, "scale_benchmark: --gpus 1..64, --gbps and --peers positive\n");
    return 2;
  }
  std::vector<int> all;
  for (int i = 0; i < gpus; ++i) all.push_back(i);
  const uint64_t mib = absl::GetFlag(FLAGS_mib_per_gpu);
  kvferry::ReportStripe("buffers on every GPU", kvferry::Stripe(all, mib));
  kvferry::ReportStripe("buffer on GPU 0 alone", kvferry::Stripe({0}, mib * gpus));
  kvferry::PeersMemory();
  return 0;
}
