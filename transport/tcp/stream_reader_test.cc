#include "transport/tcp/stream_reader.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace {

class StreamReaderTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(0, socketpair(AF_UNIX, SOCK_STREAM, 0, fds_)); }
  void TearDown() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  void Send(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = write(fds_[1], p, n);
      ASSERT_GT(w, 0);
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  int fds_[2] = {-1, -1};
};

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

// Many small messages sent at once come out whole and in order, from one
// buffer: after the first read the rest are already received.
TEST_F(StreamReaderTest, SmallMessagesComeOutOfOneBuffer) {
  std::vector<char> all;
  for (int i = 0; i < 8; ++i) {
    std::vector<char> m = Pattern(40 + i, i);
    all.insert(all.end(), m.begin(), m.end());
  }
  Send(all.data(), all.size());
  StreamReader in(fds_[0]);
  size_t off = 0;
  for (int i = 0; i < 8; ++i) {
    std::vector<char> got(40 + i);
    ASSERT_TRUE(in.Read(got.data(), got.size()).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), all.data() + off, got.size())) << "message " << i;
    off += got.size();
    if (i == 0) EXPECT_EQ(all.size() - got.size(), in.Buffered());
  }
  EXPECT_EQ(0u, in.Buffered());
}

// A payload of kDirect bytes or more after a header: the buffered part is
// copied out first, the rest is read straight into the destination, and
// what follows it still reads correctly.
TEST_F(StreamReaderTest, LargePayloadAfterAHeaderGoesStraightIn) {
  const std::vector<char> header = Pattern(32, 1);
  const std::vector<char> payload = Pattern(3 * StreamReader::kCapacity + 17, 2);
  const std::vector<char> trailer = Pattern(24, 3);
  std::thread sender([&] {
    Send(header.data(), header.size());
    Send(payload.data(), payload.size());
    Send(trailer.data(), trailer.size());
  });
  StreamReader in(fds_[0]);
  std::vector<char> h(header.size()), p(payload.size()), t(trailer.size());
  ASSERT_TRUE(in.Read(h.data(), h.size()).ok());
  ASSERT_TRUE(in.Read(p.data(), p.size()).ok());
  ASSERT_TRUE(in.Read(t.data(), t.size()).ok());
  sender.join();
  EXPECT_EQ(header, h);
  EXPECT_EQ(payload, p);
  EXPECT_EQ(trailer, t);
}

// A message that arrives in pieces (each its own recv) is put together.
TEST_F(StreamReaderTest, MessageArrivingInPiecesIsWhole) {
  const std::vector<char> m = Pattern(9000, 4);
  std::thread sender([&] {
    for (size_t off = 0; off < m.size(); off += 1000) {
      Send(m.data() + off, std::min<size_t>(1000, m.size() - off));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  StreamReader in(fds_[0]);
  std::vector<char> got(m.size());
  ASSERT_TRUE(in.Read(got.data(), got.size()).ok());
  sender.join();
  EXPECT_EQ(m, got);
}

TEST_F(StreamReaderTest, SkipDropsBytesAcrossBuffers) {
  const std::vector<char> skipped = Pattern(2 * StreamReader::kCapacity + 5, 5);
  const std::vector<char> kept = Pattern(100, 6);
  std::thread sender([&] {
    Send(skipped.data(), skipped.size());
    Send(kept.data(), kept.size());
  });
  StreamReader in(fds_[0]);
  ASSERT_TRUE(in.Skip(skipped.size()).ok());
  std::vector<char> got(kept.size());
  ASSERT_TRUE(in.Read(got.data(), got.size()).ok());
  sender.join();
  EXPECT_EQ(kept, got);
}

// A read takes at most ReadAhead bytes beyond what it was asked for: the
// rest stay in the socket (where a large payload goes straight to its
// destination). A direct read takes the bytes behind it too.
TEST_F(StreamReaderTest, ReadAheadBoundsWhatIsTakenBeyondARead) {
  const size_t big = StreamReader::kDirect * 2;
  const std::vector<char> all = Pattern(1000 + big + 1000, 8);
  Send(all.data(), all.size());
  StreamReader in(fds_[0]);
  in.ReadAhead(0);
  std::vector<char> got(100);
  ASSERT_TRUE(in.Read(got.data(), got.size()).ok());
  EXPECT_EQ(0u, in.Buffered());
  EXPECT_EQ(0, std::memcmp(got.data(), all.data(), got.size()));
  in.ReadAhead(50);
  ASSERT_TRUE(in.Read(got.data(), got.size()).ok());
  EXPECT_EQ(50u, in.Buffered());
  EXPECT_EQ(0, std::memcmp(got.data(), all.data() + 100, got.size()));
  in.ReadAhead(0);
  std::vector<char> rest(800);
  ASSERT_TRUE(in.Read(rest.data(), rest.size()).ok());
  EXPECT_EQ(0, std::memcmp(rest.data(), all.data() + 200, rest.size()));
  EXPECT_EQ(0u, in.Buffered());
  // 1000 bytes read; a direct read of `big` takes 24 more behind it.
  in.ReadAhead(24);
  std::vector<char> payload(big);
  ASSERT_TRUE(in.Read(payload.data(), payload.size()).ok());
  EXPECT_EQ(0, std::memcmp(payload.data(), all.data() + 1000, big));
  EXPECT_EQ(24u, in.Buffered());
  std::vector<char> tail(1000);
  ASSERT_TRUE(in.Read(tail.data(), tail.size()).ok());
  EXPECT_EQ(0, std::memcmp(tail.data(), all.data() + 1000 + big, tail.size()));
}

// A payload of exactly kDirect bytes whose first bytes were read ahead
// with its header: those few are copied out of the buffer, the rest goes
// straight into place (not through the buffer: the whole read decides).
TEST_F(StreamReaderTest, APayloadPartlyReadAheadStillGoesStraightIn) {
  const std::vector<char> header = Pattern(40, 9);
  const std::vector<char> payload = Pattern(StreamReader::kDirect, 10);
  const std::vector<char> trailer = Pattern(40, 11);
  std::vector<char> all = header;
  all.insert(all.end(), payload.begin(), payload.end());
  all.insert(all.end(), trailer.begin(), trailer.end());
  Send(all.data(), all.size());
  StreamReader in(fds_[0]);
  in.ReadAhead(header.size());  // as the link's reader does while payloads are large
  std::vector<char> h(header.size()), p(payload.size()), t(trailer.size());
  ASSERT_TRUE(in.Read(h.data(), h.size()).ok());
  ASSERT_EQ(header.size(), in.Buffered());  // the payload's first 40 bytes
  ASSERT_TRUE(in.Read(p.data(), p.size()).ok());
  EXPECT_EQ(header.size() + header.size(), in.Copied());
  ASSERT_TRUE(in.Read(t.data(), t.size()).ok());
  EXPECT_EQ(header, h);
  EXPECT_EQ(payload, p);
  EXPECT_EQ(trailer, t);
}

// The peer closing mid-message: kUnavailable, for a buffered read, a
// direct one and a skip.
TEST_F(StreamReaderTest, PeerClosingMidMessageIsUnavailable) {
  const std::vector<char> part = Pattern(10, 7);
  Send(part.data(), part.size());
  close(fds_[1]);
  fds_[1] = -1;
  StreamReader in(fds_[0]);
  std::vector<char> got(StreamReader::kDirect * 2);
  absl::Status s = in.Read(got.data(), 20);
  EXPECT_EQ(absl::StatusCode::kUnavailable, s.code()) << s;
  EXPECT_NE(std::string::npos, s.message().find("closed")) << s;
  EXPECT_EQ(absl::StatusCode::kUnavailable, in.Read(got.data(), got.size()).code());
  EXPECT_EQ(absl::StatusCode::kUnavailable, in.Skip(1).code());
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
