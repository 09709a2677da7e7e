// What the KV benchmarks share for the cost of end-to-end checksums: one
// request of kChecksumRequestPages pages over every buffer of a pool, sent
// and waited for (the receiver checks every page before it reports), with
// checksums off or on, between two engines built once per configuration.
#ifndef KVFERRY_BENCH_KV_CHECKSUM_COST_H_
#define KVFERRY_BENCH_KV_CHECKSUM_COST_H_

#include <cstdint>
#include <memory>

#include "benchmark/benchmark.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"

namespace kvferry {
namespace bench {

constexpr uint32_t kChecksumRequestPages = 32;

// The two engines, a sender over `src` and a receiver over `dst`.
struct KvPair {
  std::unique_ptr<TransferEngine> prefill, decode;
  std::unique_ptr<KvSender> sender;
  std::unique_ptr<KvReceiver> receiver;
};
std::unique_ptr<KvPair> MakeKvPair(std::unique_ptr<TransferEngine> prefill,
                                   std::unique_ptr<TransferEngine> decode, KvPool src, KvPool dst,
                                   bool checksums);

// The timed loop: pages 0..kChecksumRequestPages-1 to the same pages, one
// request per iteration; sets the bytes processed for `layout`.
void RunChecksummedRequests(benchmark::State& state, KvPair& pair, const KvLayout& layout);

}  // namespace bench
}  // namespace kvferry

#endif  // KVFERRY_BENCH_KV_CHECKSUM_COST_H_
