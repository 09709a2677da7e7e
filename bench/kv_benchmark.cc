// The KV layer moving one request's pages between two engines over TCP
// (loopback, one process), for real model shapes, with scattered (random)
// and contiguous page lists; next to the raw engine moving the same number
// of bytes as one block in the same run. Reports pages/s and bytes/s, and
// the ratio KV-layer / raw at the end.
//
//   ./bazelw run -c opt //bench:kv_benchmark
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "bench/kv_checksum_cost.h"
#include "benchmark/benchmark.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"
#include "sim/prng.h"

namespace kvferry {
namespace {

struct Shape {
  const char* name;
  KvLayout layout;
};

// Pages per request (32 pages of 16 tokens = 512 tokens of context).
constexpr uint32_t kRequestPages = 32;
constexpr uint32_t kPoolPages = 128;

const Shape kShapes[] = {
    // 32 layers, 8 KV heads x 128 dims bf16, K and V, 16-token pages.
    {"llama3_8b_gqa", {32, false, 16, 8 * 128 * 2, kPoolPages}},
    // 80 layers, 8 KV heads x 128 dims bf16, K and V, 16-token pages.
    {"llama3_70b_gqa", {80, false, 16, 8 * 128 * 2, kPoolPages}},
    // 61 layers, one latent of 512 + 64 rope dims bf16, 64-token pages.
    {"deepseek_v3_mla", {61, true, 64, 576 * 2, kPoolPages}},
};

std::unique_ptr<TransferEngine> Engine() {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  auto e = TransferEngine::Create(o);
  return e.ok() ? std::move(*e) : nullptr;
}

// Both engines and pools for one shape, built once.
struct Setup {
  std::unique_ptr<TransferEngine> prefill, decode;
  std::unique_ptr<KvSender> sender, quiet;  // quiet: KvSender::Options::announce off
  std::unique_ptr<KvReceiver> receiver;
  std::vector<char> raw_src, raw_dst;  // for the one-block reference
  uint64_t request_bytes = 0;
};

Setup& Get(int shape) {
  static std::map<int, std::unique_ptr<Setup>> setups;
  auto& s = setups[shape];
  if (s) return *s;
  s = std::make_unique<Setup>();
  const KvLayout& l = kShapes[shape].layout;
  s->prefill = Engine();
  s->decode = Engine();
  KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    std::memset(src.buffer(b), 1, l.buffer_bytes());  // touch every page now
    std::memset(dst.buffer(b), 0, l.buffer_bytes());
  }
  s->sender = *KvSender::Create(s->prefill.get(), src);
  KvSender::Options quiet;
  quiet.announce = false;
  KvPool quiet_src = *KvPool::Allocate(l);  // a pool registers once per engine
  for (uint32_t b = 0; b < l.buffer_count(); ++b)
    std::memset(quiet_src.buffer(b), 1, l.buffer_bytes());
  s->quiet = *KvSender::Create(s->prefill.get(), quiet_src, quiet);
  s->receiver = *KvReceiver::Create(s->decode.get(), dst);
  s->request_bytes = uint64_t{kRequestPages} * l.page_bytes() * l.buffer_count();
  s->raw_src.assign(s->request_bytes, 1);
  s->raw_dst.assign(s->request_bytes, 0);
  (void)s->prefill->RegisterMemory(s->raw_src.data(), s->raw_src.size());
  (void)s->decode->RegisterMemory(s->raw_dst.data(), s->raw_dst.size());
  return *s;
}

void BM_KvRequest(benchmark::State& state) {
  const int shape = state.range(0);
  const bool scattered = state.range(1) != 0;
  const bool announce = state.range(2) != 0;
  Setup& s = Get(shape);
  KvSender& sender = announce ? *s.sender : *s.quiet;
  std::vector<uint32_t> src(kRequestPages), dst(kRequestPages);
  sim::Prng prng(42);
  for (uint32_t i = 0; i < kRequestPages; ++i) {
    src[i] = scattered ? 2 * i : i;  // every other page vs a contiguous block
    dst[i] = scattered ? kPoolPages - 1 - 2 * i : i;
  }
  const std::string peer = s.decode->address();
  uint64_t n = 0;
  for (auto _ : state) {
    const std::string id = "bench-" + std::to_string(n++);
    if (!sender.Send(id, peer, src, dst, "").ok()) {
      state.SkipWithError("request failed");
      break;
    }
    state.PauseTiming();
    (void)s.receiver->Wait(id, absl::Seconds(30));
    s.receiver->Forget(id);
    state.ResumeTiming();
  }
  const KvLayout& l = kShapes[shape].layout;
  state.SetBytesProcessed(int64_t(state.iterations()) * s.request_bytes);
  state.counters["pages_per_sec"] = benchmark::Counter(
      double(kRequestPages) * l.buffer_count() * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(kShapes[shape].name) + (scattered ? " scattered" : " contiguous") +
                 (announce ? "" : ", no begin word"));
}

// KvSender::Begin of a one-page request alone, with the begin word
// (announce) and without: what telling a decode that only waits costs.
void BM_KvBegin(benchmark::State& state) {
  const bool announce = state.range(0) != 0;
  Setup& s = Get(0);
  KvSender& sender = announce ? *s.sender : *s.quiet;
  const std::string peer = s.decode->address();
  uint64_t n = 0;
  for (auto _ : state) {
    const std::string id = "begin-" + std::to_string(n++);
    auto h = sender.Begin(id, peer, {0}, {0});
    if (!h.ok()) {
      state.SkipWithError("Begin failed");
      break;
    }
    state.PauseTiming();
    (void)sender.Cancel(*h, "benchmark");
    (void)s.receiver->Poll(id);
    s.receiver->Forget(id);
    state.ResumeTiming();
  }
  state.SetLabel(announce ? "with the begin word" : "no begin word");
}

void BM_RawOneBlock(benchmark::State& state) {
  const int shape = state.range(0);
  Setup& s = Get(shape);
  auto seg = s.prefill->OpenSegment(s.decode->address());
  TransferRequest r{transport::Opcode::kWrite, s.raw_src.data(),
                    reinterpret_cast<uintptr_t>(s.raw_dst.data()), s.request_bytes};
  for (auto _ : state) {
    auto batch = s.prefill->Submit(*seg, {&r, 1});
    auto st = batch.ok() ? s.prefill->Wait(*batch, absl::Seconds(30))
                         : absl::StatusOr<BatchStatus>(batch.status());
    if (!st.ok() || !st->ok()) {
      state.SkipWithError("raw transfer failed");
      break;
    }
    (void)s.prefill->Release(*batch);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * s.request_bytes);
  state.SetLabel(std::string(kShapes[shape].name) + " one block");
}

// What end-to-end checksums cost: one request of 32 pages over 32 layers
// (K and V) with page_bytes per buffer, sent and waited for (the receiver
// checks every page before it reports), with checksums off and on.
void BM_KvChecksumCost(benchmark::State& state) {
  const uint64_t page_bytes = state.range(0);
  const bool checksums = state.range(1) != 0;
  static std::map<std::pair<uint64_t, bool>, std::unique_ptr<bench::KvPair>> pairs;
  auto& p = pairs[{page_bytes, checksums}];
  const KvLayout l{32, false, 1, page_bytes, 64};
  if (!p) {
    KvPool src = *KvPool::Allocate(l), dst = *KvPool::Allocate(l);
    for (uint32_t b = 0; b < l.buffer_count(); ++b) std::memset(src.buffer(b), 3, l.buffer_bytes());
    p = bench::MakeKvPair(Engine(), Engine(), std::move(src), std::move(dst), checksums);
  }
  bench::RunChecksummedRequests(state, *p, l);
  state.SetLabel(
      absl::StrCat(page_bytes >> 10, " KiB pages, checksums ", checksums ? "on" : "off"));
}

// Per shape: the raw reference, then contiguous and scattered page lists.
void Register() {
  for (int64_t page : {2 << 10, 32 << 10}) {
    for (int64_t on : {0, 1}) {
      benchmark::RegisterBenchmark("BM_KvChecksumCost", BM_KvChecksumCost)
          ->Args({page, on})
          ->UseRealTime();
    }
  }
  benchmark::RegisterBenchmark("BM_KvBegin", BM_KvBegin)->Arg(1)->Arg(0)->UseRealTime();
  for (int shape = 0; shape < 3; ++shape) {
    benchmark::RegisterBenchmark("BM_RawOneBlock", BM_RawOneBlock)->Arg(shape)->UseRealTime();
    benchmark::RegisterBenchmark("BM_KvRequest", BM_KvRequest)
        ->Args({shape, 0, 1})
        ->Args({shape, 1, 1})
        ->Args({shape, 0, 0})
        ->UseRealTime();
  }
}

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      auto it = r.counters.find("bytes_per_second");
      if (it != r.counters.end()) rates_[r.report_label] = it->second.value;
    }
  }
  void PrintRatios() {
    for (const char* page : {"2 KiB", "32 KiB"}) {
      const double off = rates_[std::string(page) + " pages, checksums off"];
      const double on = rates_[std::string(page) + " pages, checksums on"];
      if (off > 0 && on > 0) {
        std::printf("ratio checksums on / off, %s pages: %.2f (%.2f GB/s vs %.2f GB/s)\n", page,
                    on / off, on / 1e9, off / 1e9);
      }
    }
    for (const Shape& shape : kShapes) {
      const double raw = rates_[std::string(shape.name) + " one block"];
      for (const char* kind : {" contiguous", " scattered"}) {
        const double kv = rates_[std::string(shape.name) + kind];
        if (raw > 0 && kv > 0) {
          std::printf("ratio KV layer / raw one block, %s%s: %.2f (%.2f GB/s vs %.2f GB/s)\n",
                      shape.name, kind, kv / raw, kv / 1e9, raw / 1e9);
        }
      }
    }
  }

 private:
  std::map<std::string, double> rates_;
};

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  kvferry::Register();
  benchmark::Initialize(&argc, argv);
  kvferry::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  return 0;
}
