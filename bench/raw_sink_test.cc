// The raw socket reference moves the bytes it is asked to: each block from
// its place in the source into the same place of the sink's buffer,
// adjacent or scattered, and nothing between them.
#include "bench/raw_sink.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace bench {
namespace {

constexpr uint64_t kSinkBytes = 40 << 20;

struct Case {
  uint32_t count;
  uint64_t block;
  uint64_t stride;  // 0: adjacent
  uint64_t offset;
};

// The sink's buffer, shared by every test (a sink lives as long as the
// process).
char* SinkBuffer() {
  static char* buffer = new char[kSinkBytes];
  return buffer;
}

RawSink* Sink() {
  static RawSink* sink = [] {
    absl::StatusOr<RawSink*> s = RawSink::Start("127.0.0.1", SinkBuffer(), kSinkBytes);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }();
  return sink;
}

void SendAndCheck(const Case& c) {
  RawSink* sink = Sink();
  ASSERT_NE(sink, nullptr);
  const uint64_t stride = c.stride == 0 ? c.block : c.stride;
  const uint64_t span = (c.count - 1) * stride + c.block;
  ASSERT_LE(c.offset + span, kSinkBytes);
  std::vector<char> src(span);
  for (uint64_t i = 0; i < span; ++i) src[i] = static_cast<char>((i * 131 + 7) % 251);
  char* dst = SinkBuffer() + c.offset;
  std::memset(dst, 0, span);
  absl::StatusOr<net::Fd> fd = RawConnect(sink->address());
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(RawSend(fd->get(), src.data(), c.count, c.block, c.offset, c.stride).ok());
  ASSERT_TRUE(RawAwaitAck(fd->get(), absl::Now() + absl::Seconds(10)).ok())
      << "no answer from the sink: it waits for bytes that were not sent";
  for (uint64_t i = 0; i < span; ++i) {
    const bool in_block = (i % stride) < c.block;
    const char want = in_block ? src[i] : 0;
    if (dst[i] != want) {
      FAIL() << "byte " << i << " of the sink's range (block " << i / stride << ", "
             << (in_block ? "inside it" : "between blocks") << "): " << static_cast<int>(dst[i])
             << ", expected " << static_cast<int>(want);
    }
  }
}

TEST(RawSink, AdjacentBlocksLandInOrder) { SendAndCheck({16, 4096, 0, 4096}); }

TEST(RawSink, ScatteredBlocksLandInTheirPlacesAndNothingBetween) {
  SendAndCheck({16, 16384, 32768, 1 << 20});
}

// More blocks than one sendmsg takes (IOV_MAX) and more bytes than the
// socket holds at once: the gather goes on where each call stopped.
TEST(RawSink, ALargeScatteredBatchIsSentWhole) {
  SendAndCheck({2000, 64, 192, 3 << 20});
  SendAndCheck({8, 1 << 20, 3 << 20, 8 << 20});
}

}  // namespace
}  // namespace bench
}  // namespace kvferry
