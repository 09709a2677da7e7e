// Serving code's view of kvferry: a decode engine publishes a KV pool, a
// prefill engine sends a request's pages to it by host:port, the decode
// side waits for the request and checks the pages. Only public headers.
#include <cstdio>
#include <cstring>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/metrics.h"
#include "engine/transfer_engine.h"

int main() {
  kvferry::EngineOptions options;  // zero configuration
  options.local_host = "127.0.0.1";
  auto decode = kvferry::TransferEngine::Create(options);
  auto prefill = kvferry::TransferEngine::Create(options);
  if (!decode.ok() || !prefill.ok()) {
    std::fprintf(stderr, "engine: %s\n",
                 (decode.ok() ? prefill.status() : decode.status()).ToString().c_str());
    return 1;
  }
  const kvferry::KvLayout layout{4, false, 16, 1024, 64};  // 4 layers, K and V, 16 KiB pages
  auto src = kvferry::KvPool::Allocate(layout);
  auto dst = kvferry::KvPool::Allocate(layout);
  if (!src.ok() || !dst.ok()) return 1;
  for (uint32_t b = 0; b < layout.buffer_count(); ++b) {
    for (uint64_t i = 0; i < layout.buffer_bytes(); ++i)
      src->buffer(b)[i] = static_cast<char>(i + b);
  }
  auto receiver = kvferry::KvReceiver::Create(decode->get(), *dst);
  auto sender = kvferry::KvSender::Create(prefill->get(), *src);
  if (!receiver.ok() || !sender.ok()) return 1;
  const std::vector<uint32_t> src_pages = {0, 1, 2, 3, 10, 11}, dst_pages = {40, 41, 42, 43, 7, 8};
  absl::Status sent =
      (*sender)->Send("request-1", (*decode)->address(), src_pages, dst_pages, "first token: 42");
  if (!sent.ok()) {
    std::fprintf(stderr, "send: %s\n", sent.ToString().c_str());
    return 1;
  }
  auto status = (*receiver)->Wait("request-1", absl::Seconds(10));
  if (!status.ok() || status->state != kvferry::KvReceiver::State::kComplete) {
    std::fprintf(stderr, "request-1 did not complete\n");
    return 1;
  }
  for (uint32_t layer = 0; layer < layout.layers; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (size_t i = 0; i < src_pages.size(); ++i) {
        if (std::memcmp(src->page(layer, kv, src_pages[i]), dst->page(layer, kv, dst_pages[i]),
                        layout.page_bytes()) != 0) {
          std::fprintf(stderr, "page %u of layer %u differs\n", dst_pages[i], layer);
          return 1;
        }
      }
    }
  }
  // The metrics target: the decode's peer table names the prefill.
  const kvferry::EngineMetrics metrics = (*prefill)->GetMetrics();
  if (metrics.peers.empty() || metrics.peers[0].peer != (*decode)->address()) {
    std::fprintf(stderr, "metrics: the prefill's peers do not name the decode\n");
    return 1;
  }
  std::printf("consumer: %zu pages x %u layers moved from %s to %s over %s, verified; aux \"%s\"\n",
              src_pages.size(), layout.layers, (*prefill)->address().c_str(),
              (*decode)->address().c_str(), (*prefill)->detection().transport.c_str(),
              status->aux.c_str());
  return 0;
}
