#include "bench/kv_checksum_cost.h"

#include <string>
#include <utility>
#include <vector>

namespace kvferry {
namespace bench {

std::unique_ptr<KvPair> MakeKvPair(std::unique_ptr<TransferEngine> prefill,
                                   std::unique_ptr<TransferEngine> decode, KvPool src,
                                   KvPool dst, bool checksums) {
  auto p = std::make_unique<KvPair>();
  p->prefill = std::move(prefill);
  p->decode = std::move(decode);
  KvSender::Options o;
  o.checksums = checksums;
  p->sender = *KvSender::Create(p->prefill.get(), std::move(src), o);
  p->receiver = *KvReceiver::Create(p->decode.get(), std::move(dst));
  return p;
}

void RunChecksummedRequests(benchmark::State& state, KvPair& p, const KvLayout& layout) {
  std::vector<uint32_t> pages(kChecksumRequestPages);
  for (uint32_t i = 0; i < kChecksumRequestPages; ++i) pages[i] = i;
  const std::string peer = p.decode->address();
  uint64_t n = 0;
  for (auto _ : state) {
    const std::string id = "crc-" + std::to_string(n++);
    auto done = p.sender->Send(id, peer, pages, pages, "").ok()
                    ? p.receiver->Wait(id, absl::Seconds(30))
                    : absl::StatusOr<KvReceiver::Status>(absl::InternalError("send"));
    if (!done.ok() || done->state != KvReceiver::State::kComplete) {
      state.SkipWithError("request failed");
      break;
    }
    p.receiver->Forget(id);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * kChecksumRequestPages *
                          layout.page_bytes() * layout.buffer_count());
}

}  // namespace bench
}  // namespace kvferry
