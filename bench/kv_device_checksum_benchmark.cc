// What KV checksums cost on GPU pools, through the fake CUDA driver
// (//cuda/testing): one request of 32 pages over 32 layers (K and V) with
// 2 KiB or 32 KiB pages, between two engines over TCP in one process, with
// checksums off and on, for host pools and for device pools in the same
// run. On device pools the CRC-32C of every page is computed from pinned
// host pieces the driver copies (cuda::Driver::ReadDevice) on both sides;
// the fake's "device" copies run at memory speed, so what this measures is
// the CPU's share: the extra copy into pinned memory and the hand-offs. On
// a GPU the piece copies cross PCIe or NVLink instead.
//
//   ./bazelw run -c opt //bench:kv_device_checksum_benchmark
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/kv_checksum_cost.h"
#include "benchmark/benchmark.h"
#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"

namespace kvferry {
namespace {

std::unique_ptr<TransferEngine> Engine() {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  auto e = TransferEngine::Create(o);
  return e.ok() ? std::move(*e) : nullptr;
}

// A pool of `l` on device `ordinal` (-1: host), filled.
KvPool Pool(const KvLayout& l, int ordinal) {
  if (ordinal < 0) {
    KvPool p = *KvPool::Allocate(l);
    for (uint32_t b = 0; b < l.buffer_count(); ++b) std::memset(p.buffer(b), 3, l.buffer_bytes());
    return p;
  }
  const cuda::Driver* d = cuda::Driver::Get();
  std::vector<void*> buffers;
  const std::vector<char> fill(l.buffer_bytes(), 3);
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    void* p = *d->AllocDevice(ordinal, l.buffer_bytes());
    (void)d->Copy(p, fill.data(), fill.size(), ordinal);
    buffers.push_back(p);
  }
  return *KvPool::Wrap(l, buffers);
}

void BM_KvChecksum(benchmark::State& state) {
  const uint64_t page_bytes = state.range(0);
  const bool device = state.range(1) != 0;
  const bool checksums = state.range(2) != 0;
  static std::map<std::tuple<uint64_t, bool, bool>, std::unique_ptr<bench::KvPair>> pairs;
  auto& p = pairs[{page_bytes, device, checksums}];
  const KvLayout l{32, false, 1, page_bytes, 64};
  if (!p) {
    p = bench::MakeKvPair(Engine(), Engine(), Pool(l, device ? 0 : -1), Pool(l, device ? 1 : -1),
                          checksums);
  }
  bench::RunChecksummedRequests(state, *p, l);
  state.SetLabel(absl::StrCat(page_bytes >> 10, " KiB ", device ? "device" : "host", ", checksums ",
                              checksums ? "on" : "off"));
}

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      auto it = r.counters.find("bytes_per_second");
      if (it != r.counters.end()) rates_[r.report_label] = it->second.value;
    }
  }
  void PrintRatios() {
    for (const char* page : {"2 KiB", "32 KiB"}) {
      for (const char* where : {"host", "device"}) {
        const std::string key = absl::StrCat(page, " ", where, ", checksums ");
        const double off = rates_[key + "off"], on = rates_[key + "on"];
        if (off > 0 && on > 0) {
          std::printf("ratio checksums on / off, %s pages, %s pools: %.2f (%.2f vs %.2f GB/s)\n",
                      page, where, on / off, on / 1e9, off / 1e9);
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
  // Four device pools of 128 MiB at 32 KiB pages, kept for the run.
  setenv("KVFERRY_FAKE_CUDA_MIB", "1024", 0);
  if (kvferry::cuda::UseFakeDriver() == nullptr) return 1;
  for (int64_t page : {2 << 10, 32 << 10}) {
    for (int64_t device : {0, 1}) {
      for (int64_t on : {0, 1}) {
        benchmark::RegisterBenchmark("BM_KvChecksum", kvferry::BM_KvChecksum)
            ->Args({page, device, on})
            ->UseRealTime();
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  kvferry::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  return 0;
}
