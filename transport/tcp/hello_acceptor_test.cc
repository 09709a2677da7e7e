// The data port's front door against hostile clients on loopback: silent
// connections do not hold up others (no slowloris), unclaimed connections
// are closed by a timer, the pending count is capped, a duplicate token is
// refused, and a legitimate connection is claimed at once throughout.
#include "transport/tcp/hello_acceptor.h"

#include <sys/socket.h>

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "base/mutex.h"
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
  auto claimed_first = [&] { return p.acceptor->stats().unclaimed == 1; };
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

// What a ClaimOrAwait delivery brought, once it came.
struct Delivered {
  Mutex mu;
  CondVar cv;
  bool came = false;
  absl::StatusOr<net::Fd> fd = absl::UnknownError("nothing delivered");
  HelloAcceptor::Delivery Sink() {
    return [this](absl::StatusOr<net::Fd> got) {
      MutexLock lock(&mu);
      fd = std::move(got);
      came = true;
      cv.SignalAll();
    };
  }
  bool Await(absl::Duration within) {
    MutexLock lock(&mu);
    return cv.AwaitWithDeadline(&mu, absl::Now() + within,
                                [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return came; });
  }
};

// A claim made before the hello: nothing waits; the connection is handed
// over when its hello arrives. A claim made after it gets it at once.
TEST(HelloAcceptorTest, AClaimBeforeTheHelloGetsTheConnectionWhenItArrives) {
  Port p = Open({});
  Delivered later;
  auto now = p.acceptor->ClaimOrAwait(7, absl::Now() + absl::Seconds(10), later.Sink());
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_FALSE(now->valid());
  EXPECT_EQ(p.acceptor->stats().claims, 1u);
  EXPECT_EQ(
      p.acceptor->ClaimOrAwait(7, absl::Now() + absl::Seconds(10), later.Sink()).status().code(),
      absl::StatusCode::kAlreadyExists);
  net::Fd client = Dial(p);
  SayHello(client.get(), 7);
  ASSERT_TRUE(later.Await(absl::Seconds(5)));
  ASSERT_TRUE(later.fd.ok()) << later.fd.status();
  ASSERT_EQ(::send(later.fd->get(), "x", 1, MSG_NOSIGNAL), 1);
  char c;
  EXPECT_TRUE(net::ReadFull(client.get(), &c, 1, absl::Now() + absl::Seconds(2)).ok());
  EXPECT_EQ(p.acceptor->stats().claims, 0u);

  net::Fd first = Dial(p);
  SayHello(first.get(), 8);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (p.acceptor->stats().unclaimed != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  Delivered unused;
  auto at_once = p.acceptor->ClaimOrAwait(8, absl::Now() + absl::Seconds(10), unused.Sink());
  ASSERT_TRUE(at_once.ok()) << at_once.status();
  EXPECT_TRUE(at_once->valid());
  EXPECT_FALSE(unused.Await(absl::Milliseconds(100)));
}

// Claims whose connection never comes end at their deadline, or after
// claim_wait if that is sooner (counted); at max_pending the oldest claim
// is failed to make room for a new one (counted); an acceptor destroyed
// delivers nothing.
TEST(HelloAcceptorTest, AwaitedClaimsExpireSoonAndTheOldestMakesRoom) {
  HelloAcceptorOptions o;
  o.max_pending = 2;
  o.claim_wait = absl::Milliseconds(500);
  Port p = Open(o);
  Delivered one, two, three;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(p.acceptor->ClaimOrAwait(1, absl::Now() + absl::Seconds(10), one.Sink()).ok());
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(p.acceptor->ClaimOrAwait(2, absl::Now() + absl::Seconds(10), two.Sink()).ok());
  // The cap: the oldest, one, goes; three waits.
  ASSERT_TRUE(p.acceptor->ClaimOrAwait(3, absl::Now() + absl::Seconds(10), three.Sink()).ok());
  ASSERT_TRUE(one.Await(absl::Seconds(1)));
  EXPECT_EQ(one.fd.status().code(), absl::StatusCode::kResourceExhausted) << one.fd.status();
  EXPECT_EQ(p.acceptor->stats().claims_evicted, 1u);
  EXPECT_EQ(p.acceptor->stats().claims, 2u);
  for (Delivered* d : {&two, &three}) {
    ASSERT_TRUE(d->Await(absl::Seconds(5)));
    EXPECT_EQ(d->fd.status().code(), absl::StatusCode::kUnavailable) << d->fd.status();
  }
  // Within claim_wait and a sweep, not their 10 s deadlines.
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(p.acceptor->stats().claims_expired, 2u);
  EXPECT_EQ(p.acceptor->stats().claims, 0u);
  // Then the acceptor goes away with a claim waiting.
  Delivered four;
  ASSERT_TRUE(p.acceptor->ClaimOrAwait(4, absl::Now() + absl::Seconds(10), four.Sink()).ok());
  p.acceptor.reset();
  EXPECT_FALSE(four.Await(absl::Milliseconds(100)));
}

// A hello refused for its secret fails the claim for its token, whether
// the claim came first or after.
TEST(HelloAcceptorTest, ARefusedHelloFailsItsClaim) {
  HelloAcceptorOptions o;
  o.secret = "0123456789abcdef-secret";
  Port p = Open(o);
  Delivered first;
  ASSERT_TRUE(p.acceptor->ClaimOrAwait(4, absl::Now() + absl::Seconds(10), first.Sink()).ok());
  net::Fd a = Dial(p);
  const std::string wrong = EncodeHello(4, "another-secret-0123456789");
  ASSERT_TRUE(
      net::WriteFull(a.get(), wrong.data(), wrong.size(), absl::Now() + absl::Seconds(2)).ok());
  ASSERT_TRUE(first.Await(absl::Seconds(5)));
  EXPECT_EQ(first.fd.status().code(), absl::StatusCode::kPermissionDenied) << first.fd.status();

  net::Fd b = Dial(p);
  SayHello(b.get(), 5);  // plain where a secret is needed
  EXPECT_TRUE(Closed(b.get(), absl::Seconds(2)));
  Delivered after;
  EXPECT_EQ(
      p.acceptor->ClaimOrAwait(5, absl::Now() + absl::Seconds(10), after.Sink()).status().code(),
      absl::StatusCode::kPermissionDenied);
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
    ASSERT_TRUE(
        net::WriteFull(fd.get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(2)).ok());
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
