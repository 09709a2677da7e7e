#include "net/socket.h"

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <set>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace net {
namespace {

TEST(ParseHostPort, AcceptsIpv4HostnamesAndBracketedIpv6) {
  auto a = ParseHostPort("10.0.0.1:15000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "10.0.0.1");
  EXPECT_EQ(a->port, 15000);
  auto b = ParseHostPort("decode-7.cluster.local:16001");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "decode-7.cluster.local");
  auto c = ParseHostPort("[::1]:15001");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(c->port, 15001);
  EXPECT_EQ(c->ToString(), "[::1]:15001");
  EXPECT_EQ(a->ToString(), "10.0.0.1:15000");
}

TEST(ParseHostPort, RejectsWithAClearMessage) {
  for (const char* bad : {"", "host", "host:", ":15000", "host:65536", "host:-1", "host:12a",
                          "::1:15000", "[::1]", "[::1]15000", "[::1:15000"}) {
    auto r = ParseHostPort(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("expected host:port"), std::string::npos);
  }
}

// A host part with ':' in it: the message says which mistake it is.
TEST(ParseHostPort, SaysWhatIsWrongWithColonsInTheHost) {
  const std::pair<const char*, const char*> cases[] = {
      {"localhost:10010:10010", "more than one ':' and 'localhost:10010' is not an IPv6 address"},
      {"fe80::1", "'fe80::1' is an IPv6 address without a port: write it as [fe80::1]:PORT"},
      {"2001:db8::7:15000", "an IPv6 address goes in brackets: [2001:db8::7]:15000"},
      {"::1:8080", "an IPv6 address goes in brackets: [::1]:8080"},
      {"10.0.0.1:80:90", "'10.0.0.1:80' is not an IPv6 address"},
  };
  for (const auto& [text, want] : cases) {
    auto r = ParseHostPort(text);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status();
  }
}

// "::" binds every interface, IPv4 included (not IPv6 only).
TEST(Listen, UnspecifiedIpv6AddressAlsoTakesIpv4) {
  auto any = Listen("::", 0, {15000, 17000});
  if (!any.ok()) GTEST_SKIP() << "no IPv6 on this host: " << any.status();
  const uint16_t port = any->address.port();
  for (const std::string host : {"127.0.0.1", "::1"}) {
    auto c = Connect(HostPort{host, port}, absl::Seconds(2));
    EXPECT_TRUE(c.ok()) << host << ": " << c.status();
    if (c.ok()) EXPECT_TRUE(Accept(any->fd.get(), absl::Seconds(2)).ok()) << host;
  }
}

TEST(Listen, HundredListenersInOneProcessGetDistinctPorts) {
  std::vector<ListeningSocket> sockets;
  std::set<uint16_t> ports;
  for (int i = 0; i < 100; ++i) {
    auto s = Listen("127.0.0.1", 0, {15000, 17000});
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_GE(s->address.port(), 15000);
    EXPECT_LE(s->address.port(), 17000);
    ports.insert(s->address.port());
    sockets.push_back(std::move(*s));
  }
  EXPECT_EQ(ports.size(), 100u);
}

TEST(Listen, HundredProcessesStartingAtOnceGetDistinctPorts) {
  // Each child takes a port from a small range and reports it; children hold
  // their socket until all have reported, as running engines would.
  int report[2], hold[2];
  ASSERT_EQ(::pipe(report), 0);
  ASSERT_EQ(::pipe(hold), 0);
  std::vector<pid_t> children;
  for (int i = 0; i < 100; ++i) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(report[0]);
      ::close(hold[1]);
      auto s = Listen("127.0.0.1", 0, {16100, 16299});
      uint16_t port = s.ok() ? s->address.port() : 0;
      if (::write(report[1], &port, sizeof port) != sizeof port) ::_exit(2);
      char c;
      (void)!::read(hold[0], &c, 1);  // returns at EOF: the parent is done
      ::_exit(s.ok() ? 0 : 1);
    }
    children.push_back(pid);
  }
  ::close(report[1]);
  ::close(hold[0]);
  std::set<uint16_t> ports;
  for (int i = 0; i < 100; ++i) {
    uint16_t port = 0;
    ASSERT_EQ(::read(report[0], &port, sizeof port), (ssize_t)sizeof port);
    EXPECT_NE(port, 0);
    ports.insert(port);
  }
  ::close(hold[1]);
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(ports.size(), 100u);
  ::close(report[0]);
}

TEST(Listen, ExhaustedRangeAndBadInput) {
  std::vector<ListeningSocket> held;
  for (int i = 0; i < 3; ++i) {
    auto s = Listen("127.0.0.1", 0, {16500, 16502});
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  auto full = Listen("127.0.0.1", 0, {16500, 16502});
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("16500 to 16502"), std::string::npos);
  EXPECT_EQ(Listen("not-an-ip", 0, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // An explicit port that is taken.
  auto taken = Listen("127.0.0.1", held[0].address.port(), {});
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(Connect, RefusedIsUnavailableQuickly) {
  // Take a port, then close it so nobody listens there.
  uint16_t port;
  {
    auto s = Listen("127.0.0.1", 0, {16600, 16700});
    ASSERT_TRUE(s.ok());
    port = s->address.port();
  }
  const absl::Time start = absl::Now();
  auto fd = Connect({"127.0.0.1", port}, absl::Seconds(2));
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(fd.status().message().find("127.0.0.1:"), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(Connect, UnresolvableNameIsNotFound) {
  EXPECT_EQ(Connect({"no-such-host.invalid", 1}, absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Connect, Ipv6LoopbackWorksAndDataFlows) {
  auto s = Listen("::1", 0, {16700, 16800});
  ASSERT_TRUE(s.ok()) << s.status();
  auto c = Connect({"::1", s->address.port()}, absl::Seconds(2));
  ASSERT_TRUE(c.ok()) << c.status();
  auto a = Accept(s->fd.get(), absl::Seconds(2));
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(WriteFull(c->get(), "hello", 5, deadline).ok());
  char buf[5];
  ASSERT_TRUE(ReadFull(a->get(), buf, 5, deadline).ok());
  EXPECT_EQ(std::string(buf, 5), "hello");
  EXPECT_EQ(s->address.ToString().substr(0, 5), "[::1]");
}

// ConnectStart returns before the connection is up; bytes written then
// arrive once it is, and a refused connection fails (at once, or at the
// first write) as kUnavailable.
TEST(ConnectStart, ConnectsInTheBackgroundAndFailsAtFirstUse) {
  auto s = Listen("127.0.0.1", 0, {16800, 16900});
  ASSERT_TRUE(s.ok()) << s.status();
  auto c = ConnectStart({"127.0.0.1", s->address.port()});
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  ASSERT_TRUE(WriteFull(c->get(), "early", 5, deadline).ok());
  auto a = Accept(s->fd.get(), absl::Seconds(2));
  ASSERT_TRUE(a.ok()) << a.status();
  char buf[5];
  ASSERT_TRUE(ReadFull(a->get(), buf, 5, deadline).ok());
  EXPECT_EQ(std::string(buf, 5), "early");

  const uint16_t closed = s->address.port();
  s->fd = Fd();  // nobody listens there now
  auto refused = ConnectStart({"127.0.0.1", closed});
  absl::Status first_use =
      refused.ok() ? WriteFull(refused->get(), "x", 1, deadline) : refused.status();
  if (first_use.ok()) {  // the refusal may come after the write
    char b;
    first_use = ReadFull(refused->get(), &b, 1, deadline);
  }
  EXPECT_EQ(first_use.code(), absl::StatusCode::kUnavailable) << first_use;
}

// A loopback connection: the listener, the connecting end and the
// accepted one.
struct Loopback {
  ListeningSocket listener;
  Fd client;
  Fd accepted;
};
void Connected(Loopback* l) {
  auto s = Listen("127.0.0.1", 0, {16800, 16900});
  ASSERT_TRUE(s.ok()) << s.status();
  auto c = Connect({"127.0.0.1", s->address.port()}, absl::Seconds(2));
  ASSERT_TRUE(c.ok()) << c.status();
  auto a = Accept(s->fd.get(), absl::Seconds(2));
  ASSERT_TRUE(a.ok()) << a.status();
  *l = {std::move(*s), std::move(*c), std::move(*a)};
}

TEST(ReadFull, TimesOutAndReportsPeerClose) {
  Loopback l;
  ASSERT_NO_FATAL_FAILURE(Connected(&l));
  char buf[4];
  const absl::Time start = absl::Now();
  EXPECT_EQ(ReadFull(l.accepted.get(), buf, 4, absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  l.client.Reset();
  EXPECT_EQ(ReadFull(l.accepted.get(), buf, 4, absl::Now() + absl::Seconds(2)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Accept(l.listener.fd.get(), absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A gather of more buffers than one sendmsg takes (IOV_MAX), empty ones
// among them, and more bytes than the socket holds: every byte arrives, in
// order; a peer that stops reading runs the deadline out.
TEST(WriteFullV, SendsEveryBufferInOrderAndTimesOut) {
  Loopback l;
  ASSERT_NO_FATAL_FAILURE(Connected(&l));
  std::vector<char> src(8 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>((i * 131 + 7) % 251);
  // 1,500 small buffers (every tenth empty), then one of the rest.
  std::vector<iovec> iov;
  size_t at = 0;
  for (int i = 0; i < 1500; ++i) {
    const size_t len = i % 10 == 0 ? 0 : 1 + i % 97;
    iov.push_back({src.data() + at, len});
    at += len;
  }
  iov.push_back({src.data() + at, src.size() - at});
  std::vector<char> got(src.size());
  absl::Status read;
  // The reader starts late: the sender first fills the socket and stops
  // inside a buffer.
  std::thread reader([&] {
    absl::SleepFor(absl::Milliseconds(100));
    read = ReadFull(l.accepted.get(), got.data(), got.size(), absl::Now() + absl::Seconds(20));
  });
  const absl::Status sent =
      WriteFullV(l.client.get(), iov.data(), iov.size(), absl::Now() + absl::Seconds(20));
  reader.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_TRUE(got == src) << "the bytes arrived out of order or changed";

  // Nobody reads now: the socket's buffers fill (within a few sends of
  // 8 MiB) and the deadline ends the send.
  absl::Status stuck;
  for (int i = 0; i < 16 && stuck.ok(); ++i) {
    iovec all{src.data(), src.size()};
    stuck = WriteFullV(l.client.get(), &all, 1, absl::Now() + absl::Milliseconds(200));
  }
  EXPECT_EQ(stuck.code(), absl::StatusCode::kDeadlineExceeded) << stuck;
}

TEST(Random, Differs) { EXPECT_NE(RandomU64(), RandomU64()); }

}  // namespace
}  // namespace net
}  // namespace kvferry
