#include "transport/completion_queue.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace {

// First in, first out across growth and wrap-around, every region unpinned
// once, error statuses delivered intact.
TEST(CompletionQueue, FifoAcrossGrowthAndWrapAround) {
  CompletionQueue q;
  uint64_t pushed = 0, popped = 0;
  std::vector<RegionId> unpinned;
  Completion out[7];
  for (int round = 0; round < 50; ++round) {
    for (int i = 0; i < 3 + round * 5; ++i, ++pushed) {
      WorkRequest wr;
      wr.cookie = pushed;
      wr.local_region = 1000 + pushed;
      q.Push(wr, pushed % 11 == 0 ? absl::AbortedError("flushed") : absl::OkStatus());
    }
    // Take out less than went in, so the ring wraps and grows.
    for (int k = 0; k < round * 4 + 2 && !q.empty(); ++k) {
      const size_t n = q.Pop(absl::MakeSpan(out), [&](RegionId r) { unpinned.push_back(r); });
      for (size_t j = 0; j < n; ++j, ++popped) {
        ASSERT_EQ(out[j].cookie, popped);
        EXPECT_EQ(out[j].status.code(), popped % 11 == 0 ? absl::StatusCode::kAborted
                                                         : absl::StatusCode::kOk);
      }
    }
  }
  while (!q.empty()) {
    const size_t n = q.Pop(absl::MakeSpan(out), [&](RegionId r) { unpinned.push_back(r); });
    for (size_t j = 0; j < n; ++j, ++popped) ASSERT_EQ(out[j].cookie, popped);
  }
  EXPECT_EQ(popped, pushed);
  ASSERT_EQ(unpinned.size(), pushed);
  for (uint64_t i = 0; i < pushed; ++i) EXPECT_EQ(unpinned[i], 1000 + i);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
