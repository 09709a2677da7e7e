// The data port's front door against hostile clients on loopback: silent
// connections do not hold up others (no slowloris), unclaimed connections
// are closed by a timer, the pending count is capped, a duplicate token is
// refused, and a legitimate connection is claimed at once throughout.
#include "transport/tcp/hello_acceptor.h"

#include <sys/socket.h>

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "net/socket.h"

namespace kvferry {
namespace transport {
namespace {

struct Port {
  net::ListeningSocket socket;
  std::unique_ptr<HelloAcceptor> acceptor;
  net::HostPort at;
};

Port Open(HelloAcceptorOptions o) {
  Port p;
  auto s = net::Listen("127.0.0.1", 0, {0, 0});
  EXPECT_TRUE(s.ok());
  p.socket = std::move(*s);
  p.at = net::HostPort{"127.0.0.1", p.socket.address.port()};
  auto a = HelloAcceptor::Start(p.socket.fd.get(), o);
  EXPECT_TRUE(a.ok()) << a.status();
  p.acceptor = std::move(*a);
  return p;
}

net::Fd Dial(const Port& p) {
  auto fd = net::Connect(p.at, absl::Seconds(2));
  EXPECT_TRUE(fd.ok()) << fd.status();
  return fd.ok() ? std::move(*fd) : net::Fd();
}

void SayHello(int fd, uint64_t token, uint64_t magic = kHelloMagic) {
  char hello[kHelloBytes];
  std::memcpy(hello, &magic, 8);
  std::memcpy(hello + 8, &token, 8);
  ASSERT_TRUE(net::WriteFull(fd, hello, sizeof hello, absl::Now() + absl::Seconds(2)).ok());
}

bool Closed(int fd, absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  char buf[16];
  while (absl::Now() < deadline) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// A legitimate link's connection is claimed quickly; returns the time.
absl::Duration Legitimate(const Port& p, uint64_t token) {
  const absl::Time start = absl::Now();
  net::Fd fd = Dial(p);
  SayHello(fd.get(), token);
  auto claimed = p.acceptor->Claim(token, absl::Now() + absl::Seconds(2));
  EXPECT_TRUE(claimed.ok()) << claimed.status();
  return absl::Now() - start;
}

TEST(HelloAcceptorTest, SilentConnectionsDoNotDelayOthersAndAreClosed) {
  HelloAcceptorOptions o;
  o.hello_timeout = absl::Milliseconds(300);
  Port p = Open(o);
  std::vector<net::Fd> silent;
  for (int i = 0; i < 20; ++i) silent.push_back(Dial(p));
  ASSERT_EQ(::send(silent[0].get(), "KVF", 3, MSG_NOSIGNAL), 3);  // a partial hello
  EXPECT_LT(Legitimate(p, 1), absl::Milliseconds(250));
  for (auto& fd : silent) EXPECT_TRUE(Closed(fd.get(), absl::Seconds(3)));
  EXPECT_GE(p.acceptor->stats().bad_hellos, 20u);
}

TEST(HelloAcceptorTest, UnclaimedConnectionsExpireByTimer) {
  HelloAcceptorOptions o;
  o.claim_timeout = absl::Milliseconds(200);
  Port p = Open(o);
  net::Fd fd = Dial(p);
  SayHello(fd.get(), 42);
  // Nothing else arrives; the timer closes it anyway.
  EXPECT_TRUE(Closed(fd.get(), absl::Seconds(3)));
  EXPECT_EQ(p.acceptor->stats().expired, 1u);
  EXPECT_EQ(p.acceptor->stats().pending, 0u);
  EXPECT_FALSE(p.acceptor->Claim(42, absl::Now()).ok());
}

TEST(HelloAcceptorTest, PendingConnectionsAreCapped) {
  HelloAcceptorOptions o;
  o.max_pending = 8;
  Port p = Open(o);
  std::vector<net::Fd> fds;
  for (int i = 0; i < 30; ++i) {
    fds.push_back(Dial(p));
    SayHello(fds.back().get(), 1000 + i);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (p.acceptor->stats().accepted < 30 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_LE(p.acceptor->stats().pending, 8u);
  EXPECT_GE(p.acceptor->stats().evicted, 22u);
  // The server closed what it evicted (which ones depends on how far each
  // had got: those still without their hello go first).
  int closed = 0;
  for (auto& fd : fds) closed += Closed(fd.get(), absl::Milliseconds(20));
  EXPECT_GE(closed, 22);
  EXPECT_LT(Legitimate(p, 7), absl::Seconds(2));
}

TEST(HelloAcceptorTest, ADuplicateTokenIsRefusedAndTheFirstKept) {
  Port p = Open({});
  net::Fd first = Dial(p);
  SayHello(first.get(), 5);
  auto claimed_first = [&] { return p.acceptor->stats().pending == 1; };
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!claimed_first() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  net::Fd second = Dial(p);
  SayHello(second.get(), 5);
  EXPECT_TRUE(Closed(second.get(), absl::Seconds(2)));
  EXPECT_EQ(p.acceptor->stats().duplicate_tokens, 1u);
  auto fd = p.acceptor->Claim(5, absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(fd.ok());
  // The one claimed is the first: it reaches `first`.
  ASSERT_EQ(::send(fd->get(), "x", 1, MSG_NOSIGNAL), 1);
  char c;
  EXPECT_TRUE(net::ReadFull(first.get(), &c, 1, absl::Now() + absl::Seconds(2)).ok());
}

TEST(HelloAcceptorTest, AWrongMagicIsDropped) {
  Port p = Open({});
  net::Fd fd = Dial(p);
  SayHello(fd.get(), 9, 0x1234);
  EXPECT_TRUE(Closed(fd.get(), absl::Seconds(2)));
  EXPECT_FALSE(p.acceptor->Claim(9, absl::Now() + absl::Milliseconds(50)).ok());
  EXPECT_EQ(p.acceptor->stats().bad_hellos, 1u);
}

// With a secret, a connection must prove it: a plain hello, a wrong tag or
// another secret's tag is dropped; the right one is claimed.
TEST(HelloAcceptorTest, WithASecretOnlyAuthenticatedHellosAreAccepted) {
  HelloAcceptorOptions o;
  o.secret = "0123456789abcdef-secret";
  Port p = Open(o);
  net::Fd plain = Dial(p);
  SayHello(plain.get(), 1);
  EXPECT_TRUE(Closed(plain.get(), absl::Seconds(2)));
  for (const std::string& secret : {std::string("another-secret-0123456789"), o.secret}) {
    net::Fd fd = Dial(p);
    const std::string hello = EncodeHello(2, secret);
    ASSERT_EQ(hello.size(), kAuthHelloBytes);
    ASSERT_TRUE(net::WriteFull(fd.get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(2))
                    .ok());
    if (secret != o.secret) {
      EXPECT_TRUE(Closed(fd.get(), absl::Seconds(2)));
      EXPECT_FALSE(p.acceptor->Claim(2, absl::Now() + absl::Milliseconds(50)).ok());
    } else {
      EXPECT_TRUE(p.acceptor->Claim(2, absl::Now() + absl::Seconds(2)).ok());
    }
  }
  EXPECT_EQ(p.acceptor->stats().bad_hellos, 2u);
  // Without a secret, an authenticated hello is refused as well.
  Port plain_port = Open({});
  net::Fd fd = Dial(plain_port);
  const std::string hello = EncodeHello(3, o.secret);
  ASSERT_TRUE(
      net::WriteFull(fd.get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(2)).ok());
  EXPECT_TRUE(Closed(fd.get(), absl::Seconds(2)));
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
