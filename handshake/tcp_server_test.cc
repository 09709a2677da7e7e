// The handshake server's bounds against hostile clients on loopback: no
// thread per connection, a capped connection count, buffers that grow only
// as bytes arrive, slow and idle connections reaped, and a listener that
// pauses (does not spin or wedge) at the file-descriptor limit. In each case
// a legitimate call still completes.
#include "handshake/tcp_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "handshake/tcp_network.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {
namespace {

Frame EchoHandler(const Frame& request) { return Frame{MessageType::kProbeReply, request.payload}; }

struct Served {
  std::unique_ptr<TcpServer> server;
  net::HostPort at;
};

Served Serve(TcpServerOptions o, HandingHandler handler = EchoHandler) {
  auto socket = net::Listen("127.0.0.1", 0, {0, 0});
  EXPECT_TRUE(socket.ok()) << socket.status();
  Served s;
  s.at = net::HostPort{"127.0.0.1", socket->address.port()};
  auto server = TcpServer::Start(std::move(*socket), s.at.ToString(), std::move(handler), o);
  EXPECT_TRUE(server.ok()) << server.status();
  s.server = std::move(*server);
  return s;
}

// A legitimate call on a fresh connection; returns how long it took.
absl::Duration LegitimateCall(const Served& s) {
  auto network = NewTcpNetwork();
  const absl::Time start = absl::Now();
  auto reply = network->Call(s.at.ToString(), Frame{MessageType::kProbe, Encode(Probe{1, 7})},
                             absl::Seconds(5));
  EXPECT_TRUE(reply.ok()) << reply.status();
  if (reply.ok()) EXPECT_EQ(DecodeProbe(reply->payload)->nonce, 7u);
  return absl::Now() - start;
}

net::Fd Attacker(const Served& s) {
  auto fd = net::Connect(s.at, absl::Seconds(2));
  EXPECT_TRUE(fd.ok()) << fd.status();
  return fd.ok() ? std::move(*fd) : net::Fd();
}

int Threads() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

// True when the server has closed `fd` (read returns 0 or an error)
// within `within`.
bool ClosedByServer(int fd, absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  char buf[256];
  while (absl::Now() < deadline) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

template <typename Pred>
bool Eventually(Pred pred, absl::Duration within = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + within;
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return pred();
}

TEST(TcpServerTest, ConnectionsCostNoThreads) {
  Served s = Serve({});
  const int before = Threads();
  std::vector<net::Fd> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(Attacker(s));
  ASSERT_TRUE(Eventually([&] { return s.server->stats().open == 200; }));
  EXPECT_EQ(Threads(), before);
  LegitimateCall(s);
}

TEST(TcpServerTest, AtTheCapTheQuietestConnectionMakesRoom) {
  TcpServerOptions o;
  o.max_connections = 16;
  Served s = Serve(o);
  std::vector<net::Fd> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(Attacker(s));
  ASSERT_TRUE(Eventually([&] { return s.server->stats().accepted == 40; }));
  // The count of evictions may trail the count of accepts by one.
  EXPECT_TRUE(Eventually([&] { return s.server->stats().evicted >= 24u; }));
  EXPECT_LE(s.server->stats().open, 16u);
  EXPECT_GE(s.server->stats().evicted, 24u);
  // The first ones were quietest: the server closed them.
  EXPECT_TRUE(ClosedByServer(idle[0].get(), absl::Seconds(2)));
  LegitimateCall(s);
}

TEST(TcpServerTest, AClaimedLengthAboveTheRequestLimitIsRefusedUnread) {
  Served s = Serve({});
  net::Fd fd = Attacker(s);
  // A valid header claiming 16 MiB.
  std::string header = EncodeFrame(MessageType::kNotify, "");
  const uint32_t claim = 16 << 20;
  std::memcpy(&header[4], &claim, 4);
  ASSERT_TRUE(
      net::WriteFull(fd.get(), header.data(), header.size(), absl::Now() + absl::Seconds(2)).ok());
  // The reply says why, then the connection closes.
  char reply_header[kFrameHeaderBytes];
  ASSERT_TRUE(
      net::ReadFull(fd.get(), reply_header, sizeof reply_header, absl::Now() + absl::Seconds(2))
          .ok());
  auto h = ParseFrameHeader(absl::string_view(reply_header, sizeof reply_header), 1 << 20);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->type, MessageType::kError);
  EXPECT_TRUE(ClosedByServer(fd.get(), absl::Seconds(2)));
  EXPECT_EQ(s.server->stats().refused_frames, 1u);
  LegitimateCall(s);
}

// Sends the first `bytes` of a notification claiming 1 MiB (a large
// request) on a fresh connection.
net::Fd PartialNotify(const Served& s, size_t bytes) {
  net::Fd fd = Attacker(s);
  const std::string frame = EncodeFrame(MessageType::kNotify, std::string(1 << 20, 'x'));
  EXPECT_TRUE(net::WriteFull(fd.get(), frame.data(), bytes, absl::Now() + absl::Seconds(2)).ok());
  return fd;
}

TEST(TcpServerTest, OverTheBudgetTheBiggestHolderIsShedNotTheReader) {
  TcpServerOptions o;
  o.max_buffered_bytes = 256 << 10;  // large requests may hold 192 KiB of it
  Served s = Serve(o);
  net::Fd hog = PartialNotify(s, 150 << 10);
  ASSERT_FALSE(ClosedByServer(hog.get(), absl::Milliseconds(100)));
  // The next large request pushes the large share over: the hog goes, not
  // the newcomer.
  net::Fd newcomer = PartialNotify(s, 60 << 10);
  EXPECT_TRUE(ClosedByServer(hog.get(), absl::Seconds(3)));
  EXPECT_FALSE(ClosedByServer(newcomer.get(), absl::Milliseconds(100)));
  EXPECT_GE(s.server->stats().shed, 1u);
  // A request that alone would hold more than the share is itself the
  // biggest holder, and goes.
  net::Fd greedy = PartialNotify(s, 200 << 10);
  EXPECT_TRUE(ClosedByServer(greedy.get(), absl::Seconds(3)));
  EXPECT_FALSE(ClosedByServer(newcomer.get(), absl::Milliseconds(50)));
  LegitimateCall(s);
}

TEST(TcpServerTest, SmallRequestsFitWhileLargeOnesHoldTheirShare) {
  TcpServerOptions o;
  o.max_buffered_bytes = 256 << 10;
  Served s = Serve(o);
  std::vector<net::Fd> hogs;
  for (int i = 0; i < 3; ++i) hogs.push_back(PartialNotify(s, 62 << 10));  // 186 of 192 KiB
  for (int i = 0; i < 20; ++i) EXPECT_LT(LegitimateCall(s), absl::Seconds(2));
  for (net::Fd& hog : hogs) EXPECT_FALSE(ClosedByServer(hog.get(), absl::Milliseconds(20)));
  EXPECT_EQ(s.server->stats().shed, 0u);
}

TEST(TcpServerTest, OneSourceHasAShareOfLargeRequests) {
  TcpServerOptions o;
  o.max_large_per_source = 2;
  Served s = Serve(o);
  net::Fd a = PartialNotify(s, 1 << 10);
  net::Fd b = PartialNotify(s, 1 << 10);
  net::Fd c = PartialNotify(s, 1 << 10);
  EXPECT_TRUE(ClosedByServer(c.get(), absl::Seconds(3)));
  EXPECT_FALSE(ClosedByServer(a.get(), absl::Milliseconds(50)));
  EXPECT_FALSE(ClosedByServer(b.get(), absl::Milliseconds(50)));
  // One ends: its share is free again.
  a.Reset();
  absl::SleepFor(absl::Milliseconds(100));
  net::Fd d = PartialNotify(s, 1 << 10);
  EXPECT_FALSE(ClosedByServer(d.get(), absl::Milliseconds(100)));
  LegitimateCall(s);
}

TEST(TcpServerTest, AHeaderMayClaimOnlyWhatItsTypeNeeds) {
  Served s = Serve(TcpServerOptions{});
  // A probe that claims 100 KiB: refused at its header, before its bytes.
  std::string header = EncodeFrame(MessageType::kProbe, "");
  const uint32_t claim = 100 << 10;
  std::memcpy(&header[4], &claim, 4);
  net::Fd fd = Attacker(s);
  ASSERT_EQ(::send(fd.get(), header.data(), header.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(header.size()));
  EXPECT_TRUE(ClosedByServer(fd.get(), absl::Seconds(3)));
  EXPECT_EQ(s.server->stats().refused_frames, 1u);
  LegitimateCall(s);
}

TEST(TcpServerTest, SlowAndIdleConnectionsAreReapedWhileOthersAreServed) {
  TcpServerOptions o;
  o.request_timeout = absl::Milliseconds(300);
  o.idle_timeout = absl::Milliseconds(600);
  Served s = Serve(o);
  net::Fd slow = Attacker(s);
  net::Fd idle = Attacker(s);
  // Slowloris: three bytes of a header, then silence.
  ASSERT_EQ(::send(slow.get(), "KV\x01", 3, MSG_NOSIGNAL), 3);
  // Meanwhile legitimate calls are answered at once.
  EXPECT_LT(LegitimateCall(s), absl::Milliseconds(250));
  EXPECT_TRUE(ClosedByServer(slow.get(), absl::Seconds(3)));
  EXPECT_TRUE(ClosedByServer(idle.get(), absl::Seconds(3)));
  EXPECT_GE(s.server->stats().reaped, 2u);
}

TEST(TcpServerTest, AtTheDescriptorLimitTheListenerPausesAndRecovers) {
  Served s = Serve({});
  rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  // Leave room for a handful of descriptors, then use them up with
  // connections (each costs one here and one in the server).
  int open_now = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) open_now += e->d_name[0] != '.';
  ::closedir(d);
  rlimit low = old;
  low.rlim_cur = open_now + 8;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<net::Fd> fds;
  for (int i = 0; i < 16; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(s.at.port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fds.emplace_back(fd);
    (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  const bool paused = Eventually([&] { return s.server->stats().accept_pauses > 0; });
  // Paused, not spinning: in half a second the listener retries a few
  // times (every 100 ms), not thousands.
  const uint64_t pauses_then = s.server->stats().accept_pauses;
  absl::SleepFor(absl::Milliseconds(500));
  const uint64_t pauses_later = s.server->stats().accept_pauses;
  fds.clear();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_TRUE(paused);
  EXPECT_LE(pauses_later - pauses_then, 10u);
  LegitimateCall(s);
}

// Requests the handler will not wait on are answered on the loop thread:
// with the only handler thread held by a request that waits, another
// connection's quick request is still answered, and a client that pipelines
// many quick requests gets every reply, in order.
TEST(TcpServerTest, QuickRequestsAreAnsweredWhileTheHandlerThreadsWait) {
  auto socket = net::Listen("127.0.0.1", 0, {0, 0});
  ASSERT_TRUE(socket.ok()) << socket.status();
  const net::HostPort at{"127.0.0.1", socket->address.port()};
  absl::Notification release;
  std::atomic<int> waited{0};
  TcpServerOptions o;
  o.handler_threads = 1;
  o.may_block = [](const Frame& f) { return f.type == MessageType::kConnect; };
  auto server = TcpServer::Start(
      std::move(*socket), at.ToString(),
      [&](const Frame& f) {
        if (f.type == MessageType::kConnect) {
          release.WaitForNotificationWithTimeout(absl::Seconds(10));
          ++waited;
        }
        return Frame{MessageType::kProbeReply, f.payload};
      },
      o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto network = NewTcpNetwork();
  std::thread slow([&] {
    auto reply =
        network->Call(at.ToString(), Frame{MessageType::kConnect, "wait"}, absl::Seconds(10));
    EXPECT_TRUE(reply.ok()) << reply.status();
  });
  // The one handler thread is taken.
  while ((*server)->stats().accepted < 1) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(50));

  auto quick = network->Call(at.ToString(), Frame{MessageType::kProbe, "quick"}, absl::Seconds(2));
  ASSERT_TRUE(quick.ok()) << quick.status();
  EXPECT_EQ(quick->payload, "quick");
  EXPECT_EQ(waited.load(), 0);

  // 40 pipelined requests in one write (more than one burst of answers).
  net::Fd fd = Attacker(Served{nullptr, at});
  std::string burst;
  for (int i = 0; i < 40; ++i) burst += EncodeFrame(MessageType::kProbe, std::to_string(i));
  ASSERT_TRUE(
      net::WriteFull(fd.get(), burst.data(), burst.size(), absl::Now() + absl::Seconds(2)).ok());
  for (int i = 0; i < 40; ++i) {
    char header[kFrameHeaderBytes];
    ASSERT_TRUE(net::ReadFull(fd.get(), header, sizeof header, absl::Now() + absl::Seconds(2)).ok())
        << "reply " << i;
    auto h = ParseFrameHeader(absl::string_view(header, sizeof header), 1 << 20);
    ASSERT_TRUE(h.ok()) << h.status();
    std::string payload(h->payload_bytes, '\0');
    ASSERT_TRUE(
        net::ReadFull(fd.get(), payload.data(), payload.size(), absl::Now() + absl::Seconds(2))
            .ok());
    EXPECT_EQ(payload, std::to_string(i));
  }
  EXPECT_EQ(waited.load(), 0);
  release.Notify();
  slow.join();
  EXPECT_EQ(waited.load(), 1);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry

namespace kvferry {
namespace handshake {
namespace {

// Pipelined requests are answered in order, whether answered where they
// arrive (their replies go out together) or by the handler threads, and a
// malformed request after them is refused once the replies before it are
// out.
TEST(TcpServerTest, PipelinedRepliesKeepTheirOrder) {
  auto socket = net::Listen("127.0.0.1", 0, {0, 0});
  ASSERT_TRUE(socket.ok()) << socket.status();
  const net::HostPort at{"127.0.0.1", socket->address.port()};
  TcpServerOptions o;
  o.may_block = [](const Frame& f) { return f.type == MessageType::kConnect; };
  auto server = TcpServer::Start(
      std::move(*socket), at.ToString(),
      [](const Frame& f) {
        if (f.type == MessageType::kConnect) absl::SleepFor(absl::Milliseconds(5));
        return Frame{MessageType::kProbeReply, f.payload};
      },
      o);
  ASSERT_TRUE(server.ok()) << server.status();
  net::Fd fd = Attacker(Served{nullptr, at});
  const std::vector<MessageType> types = {MessageType::kProbe,   MessageType::kProbe,
                                          MessageType::kConnect, MessageType::kProbe,
                                          MessageType::kConnect, MessageType::kProbe};
  std::string bytes;
  for (size_t i = 0; i < types.size(); ++i) bytes += EncodeFrame(types[i], std::to_string(i));
  bytes += std::string(kFrameHeaderBytes, 'x');  // no frame header
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(net::WriteFull(fd.get(), bytes.data(), bytes.size(), deadline).ok());
  for (size_t i = 0; i <= types.size(); ++i) {
    char header[kFrameHeaderBytes];
    ASSERT_TRUE(net::ReadFull(fd.get(), header, sizeof header, deadline).ok()) << "reply " << i;
    auto h = ParseFrameHeader(absl::string_view(header, sizeof header), 1 << 20);
    ASSERT_TRUE(h.ok()) << h.status();
    std::string payload(h->payload_bytes, '\0');
    ASSERT_TRUE(net::ReadFull(fd.get(), payload.data(), payload.size(), deadline).ok());
    if (i < types.size()) {
      EXPECT_EQ(h->type, MessageType::kProbeReply);
      EXPECT_EQ(payload, std::to_string(i));
    } else {
      EXPECT_EQ(h->type, MessageType::kError);
    }
  }
  EXPECT_TRUE(ClosedByServer(fd.get(), absl::Seconds(5)));
  EXPECT_EQ((*server)->stats().refused_frames, 1u);
}

// A client that sends anything after a request that hands its connection
// over did not wait for the reply: the connection is refused (an error
// reply, then closed), and nothing is handed over.
TEST(TcpServerTest, BytesAfterAHandOverRequestAreRefused) {
  std::atomic<int> handed{0};
  Served s = Serve(TcpServerOptions(), [&](const Frame& request) -> Answer {
    if (request.type != MessageType::kConnectLinksHere) return EchoHandler(request);
    return Answer(EchoHandler(request), [&](net::Fd) { ++handed; });
  });
  net::Fd fd = Attacker(s);
  const std::string bytes = EncodeFrame(MessageType::kConnectLinksHere, "") + "data too early";
  ASSERT_EQ(::send(fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  char header[kFrameHeaderBytes];
  ASSERT_TRUE(net::ReadFull(fd.get(), header, sizeof header, absl::Now() + absl::Seconds(5)).ok());
  auto h = ParseFrameHeader(absl::string_view(header, sizeof header), 1 << 20);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->type, MessageType::kError);
  EXPECT_TRUE(ClosedByServer(fd.get(), absl::Seconds(5)));
  EXPECT_EQ(handed.load(), 0);
  EXPECT_EQ(s.server->stats().handed_over, 0u);
  EXPECT_EQ(s.server->stats().refused_frames, 1u);
  // The same request on its own is handed over once its reply is out (the
  // echo handler's), and the server forgets the connection.
  net::Fd good = Attacker(s);
  const std::string request = EncodeFrame(MessageType::kConnectLinksHere, "");
  ASSERT_EQ(::send(good.get(), request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string reply(kFrameHeaderBytes, '\0');
  ASSERT_TRUE(
      net::ReadFull(good.get(), reply.data(), reply.size(), absl::Now() + absl::Seconds(5)).ok());
  for (const absl::Time give_up = absl::Now() + absl::Seconds(5);
       handed.load() == 0 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(handed.load(), 1);
  EXPECT_EQ(s.server->stats().handed_over, 1u);
  EXPECT_EQ(s.server->stats().open, 0u);
  LegitimateCall(s);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
