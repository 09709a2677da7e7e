// TCP-specific behaviour beyond the conformance suite.
#include "transport/tcp/tcp_transport.h"

#include <dirent.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "net/socket.h"
#include "transport/in_process.h"
#include "transport/stream_links.h"

namespace kvferry {
namespace transport {
namespace {

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

TEST(TcpTransport, PeersThatReconnectOftenLeakNoSockets) {
  TcpTransportOptions o;
  auto server = CreateTcpTransport(o);
  ASSERT_TRUE(server.ok());
  // Warm up once so lazily opened descriptors do not count.
  {
    auto client = CreateTcpTransport(o);
    ASSERT_TRUE(ConnectInProcess(**client, **server).ok());
  }
  const int before = OpenFds();
  for (int i = 0; i < 50; ++i) {
    auto client = CreateTcpTransport(o);
    ASSERT_TRUE(client.ok());
    ASSERT_TRUE(ConnectInProcess(**client, **server).ok());
    client->reset();                        // the peer goes away
    absl::SleepFor(absl::Milliseconds(2));  // its connection ends at the server
  }
  // The last few may still be ending; fifty would be a leak.
  EXPECT_LT(OpenFds() - before, 6);
}

// With a secret the data connections prove it: transports with the same
// secret link and move bytes; with different secrets the link is refused.
TEST(TcpTransport, DataConnectionsProveTheSecret) {
  TcpTransportOptions o;
  o.in_process_shortcut = false;
  o.connect_timeout = absl::Milliseconds(500);
  o.secret = "the-same-secret-0123456789";
  auto a = CreateTcpTransport(o);
  auto b = CreateTcpTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  auto links = ConnectInProcess(**a, **b);
  ASSERT_TRUE(links.ok()) << links.status();
  std::vector<char> src(4096, 's'), dst(4096, 0);
  auto rs = (*a)->RegisterMemory(src.data(), src.size(), Access::kNone);
  auto rd = (*b)->RegisterMemory(dst.data(), dst.size(), Access::kRemoteWrite);
  ASSERT_TRUE(rs.ok() && rd.ok());
  WorkRequest w{Opcode::kWrite, links->first, rs->id, src.data(), 4096, rd->addr, rd->keys[0], 1};
  ASSERT_TRUE((*a)->Post({&w, 1}).ok());
  Completion c;
  ASSERT_EQ((*a)->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
  EXPECT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(src, dst);
  // Another secret, or none: the link is refused as it comes up (when the
  // responder has read the hello by then) or its connection is dropped,
  // and its WRITE is refused or fails; nothing lands either way.
  std::fill(dst.begin(), dst.end(), 0);
  auto never_lands = [&](Transport& stranger) {
    auto links = ConnectInProcess(stranger, **b);
    if (!links.ok()) {
      EXPECT_EQ(links.status().code(), absl::StatusCode::kPermissionDenied) << links.status();
      return;
    }
    auto rs = stranger.RegisterMemory(src.data(), src.size(), Access::kNone);
    ASSERT_TRUE(rs.ok());
    WorkRequest w{Opcode::kWrite, links->first, rs->id, src.data(), 4096, rd->addr, rd->keys[0], 2};
    // Refused at once when the link already knows its connection was
    // dropped; else its completion says so.
    if (!stranger.Post({&w, 1}).ok()) return;
    Completion c;
    ASSERT_EQ(stranger.WaitCompletions({&c, 1}, absl::Seconds(10)), 1u);
    EXPECT_FALSE(c.status.ok());
  };
  TcpTransportOptions other = o;
  other.secret = "a-different-secret-0123456";
  auto stranger = CreateTcpTransport(other);
  ASSERT_TRUE(stranger.ok());
  never_lands(**stranger);
  TcpTransportOptions none = o;
  none.secret.clear();
  auto plain = CreateTcpTransport(none);
  ASSERT_TRUE(plain.ok());
  never_lands(**plain);
  EXPECT_EQ(dst, std::vector<char>(4096, 0));
}

// Between two transports of this process the bytes are copied inside Post:
// the completion is there when Post returns, with no socket round trip.
// Without the shortcut the same request needs the peer's answer.
// A link can run on a connection made elsewhere (the handshake's own,
// kConnectLinksHere): the offered half and the accepted half adopt the two
// ends of one connection, with no connect or hello of their own, and move
// bytes both ways. Adopting for an unknown link, or for a link that has its
// connection already, is refused, and the link keeps working.
TEST(TcpTransport, LinksCanAdoptAConnectionMadeElsewhere) {
  TcpTransportOptions o;
  o.in_process_shortcut = false;  // through the connection, not a copy
  auto a = CreateTcpTransport(o);
  auto b = CreateTcpTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  StreamLinks* sa = ExtensionOf<StreamLinks>(a->get());
  StreamLinks* sb = ExtensionOf<StreamLinks>(b->get());
  ASSERT_TRUE(sa != nullptr && sb != nullptr);
  auto listener = net::Listen("127.0.0.1", 0, {0, 0});
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto pair = [&]() -> std::pair<net::Fd, net::Fd> {
    auto near =
        net::Connect(net::HostPort{"127.0.0.1", listener->address.port()}, absl::Seconds(5));
    EXPECT_TRUE(near.ok()) << near.status();
    net::Fd far(::accept4(listener->fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    EXPECT_TRUE(far.valid());
    return {near.ok() ? std::move(*near) : net::Fd(), std::move(far)};
  };
  auto [near, far] = pair();
  auto offer = sa->OfferLink(0);
  ASSERT_TRUE(offer.ok()) << offer.status();
  auto accepted = (*b)->AcceptLink(0, (*a)->LocalEndpoint().nics[0], offer->params);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  // The accepted end arrives non-blocking, as a server's does.
  ASSERT_TRUE(sb->AdoptConnection(accepted->link, std::move(far)).ok());
  ASSERT_TRUE(sa->AdoptConnection(offer->link, std::move(near)).ok());
  ASSERT_TRUE((*a)->CompleteLink(offer->link, accepted->params).ok());

  auto [spare_near, spare_far] = pair();
  EXPECT_EQ(sa->AdoptConnection(offer->link, std::move(spare_near)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sb->AdoptConnection(accepted->link, std::move(spare_far)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sa->AdoptConnection(offer->link + 1000, net::Fd()).code(),
            absl::StatusCode::kInvalidArgument);

  std::vector<char> src(8192), dst(8192, 0), back(8192, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7);
  auto rs = (*a)->RegisterMemory(src.data(), src.size(), Access::kNone);
  auto rb = (*a)->RegisterMemory(back.data(), back.size(), Access::kNone);
  auto rd = (*b)->RegisterMemory(dst.data(), dst.size(), Access::kRemoteReadWrite);
  ASSERT_TRUE(rs.ok() && rb.ok() && rd.ok());
  WorkRequest w{Opcode::kWrite, offer->link, rs->id, src.data(), 8192, rd->addr, rd->keys[0], 1};
  WorkRequest r{Opcode::kRead, offer->link, rb->id, back.data(), 8192, rd->addr, rd->keys[0], 2};
  for (WorkRequest* wr : {&w, &r}) {
    ASSERT_TRUE((*a)->Post({wr, 1}).ok());
    Completion c;
    ASSERT_EQ((*a)->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.cookie, wr->cookie);
  }
  EXPECT_EQ(dst, src);
  EXPECT_EQ(back, src);
}

TEST(TcpTransport, InProcessPeersCopyInsidePost) {
  for (const bool shortcut : {true, false}) {
    SCOPED_TRACE(shortcut ? "shortcut" : "sockets");
    TcpTransportOptions o;
    o.in_process_shortcut = shortcut;
    auto a = CreateTcpTransport(o);
    auto b = CreateTcpTransport(o);
    ASSERT_TRUE(a.ok() && b.ok());
    auto links = ConnectInProcess(**a, **b);
    ASSERT_TRUE(links.ok()) << links.status();
    std::vector<char> src(1 << 20, 'k'), dst(1 << 20, 0);
    auto rs = (*a)->RegisterMemory(src.data(), src.size(), Access::kNone);
    auto rd = (*b)->RegisterMemory(dst.data(), dst.size(), Access::kRemoteWrite);
    ASSERT_TRUE(rs.ok() && rd.ok());
    WorkRequest w{Opcode::kWrite, links->first,
                  rs->id,         src.data(),
                  src.size(),     reinterpret_cast<uintptr_t>(dst.data()),
                  rd->keys[0],    7};
    ASSERT_TRUE((*a)->Post({&w, 1}).ok());
    Completion c[1];
    size_t n = (*a)->PollCompletions(c);
    if (shortcut) {
      ASSERT_EQ(n, 1u);
    } else {
      if (n == 0) n = (*a)->WaitCompletions(c, absl::Seconds(5));
      ASSERT_EQ(n, 1u);
    }
    EXPECT_EQ(c[0].cookie, 7u);
    EXPECT_TRUE(c[0].status.ok()) << c[0].status;
    EXPECT_EQ(dst, src);
    // The checks still hold: a READ of a write-only region is refused.
    std::vector<char> back(16);
    auto rb = (*a)->RegisterMemory(back.data(), back.size(), Access::kNone);
    ASSERT_TRUE(rb.ok());
    WorkRequest r{Opcode::kRead, links->first,
                  rb->id,        back.data(),
                  back.size(),   reinterpret_cast<uintptr_t>(dst.data()),
                  rd->keys[0],   8};
    ASSERT_TRUE((*a)->Post({&r, 1}).ok());
    n = (*a)->WaitCompletions(c, absl::Seconds(5));
    ASSERT_EQ(n, 1u);
    EXPECT_EQ(c[0].status.code(), absl::StatusCode::kPermissionDenied) << c[0].status;
  }
}

// Once one end of a link is closed (as a fence closes a failed peer's
// links), nothing the other end posts on it lands, though that end has not
// yet seen the close: over the socket, and through the in-process shortcut,
// which would otherwise copy straight into the closed end's regions. Both
// ends, with the shortcut and without.
TEST(TcpTransport, NothingLandsThroughAClosedEnd) {
  for (const bool shortcut : {true, false}) {
    for (const bool close_passive : {true, false}) {
      SCOPED_TRACE(absl::StrCat(shortcut ? "shortcut" : "sockets",
                                ", closed end: ", close_passive ? "accepting" : "connecting"));
      TcpTransportOptions o;
      o.in_process_shortcut = shortcut;
      auto a = CreateTcpTransport(o);
      auto b = CreateTcpTransport(o);
      ASSERT_TRUE(a.ok() && b.ok());
      auto links = ConnectInProcess(**a, **b);  // a's end connects, b's accepts
      ASSERT_TRUE(links.ok()) << links.status();
      Transport& closer = close_passive ? **b : **a;
      Transport& poster = close_passive ? **a : **b;
      const LinkId closed = close_passive ? links->second : links->first;
      const LinkId open = close_passive ? links->first : links->second;
      std::vector<char> src(4096, 'x'), dst(4096, 0);
      auto rs = poster.RegisterMemory(src.data(), src.size(), Access::kNone);
      auto rd = closer.RegisterMemory(dst.data(), dst.size(), Access::kRemoteWrite);
      ASSERT_TRUE(rs.ok() && rd.ok());
      WorkRequest w{Opcode::kWrite, open,       rs->id,
                    src.data(),     src.size(), reinterpret_cast<uintptr_t>(dst.data()),
                    rd->keys[0],    9};
      // The link works before the close.
      ASSERT_TRUE(poster.Post({&w, 1}).ok());
      Completion c[1];
      ASSERT_EQ(poster.WaitCompletions(c, absl::Seconds(5)), 1u);
      ASSERT_TRUE(c[0].status.ok()) << c[0].status;
      std::fill(dst.begin(), dst.end(), 0);
      ASSERT_TRUE(closer.CloseLink(closed).ok());
      // At once, before the poster's end can have seen the close.
      const absl::Status posted = poster.Post({&w, 1});
      if (posted.ok()) {
        ASSERT_EQ(poster.WaitCompletions(c, absl::Seconds(10)), 1u);
        EXPECT_FALSE(c[0].status.ok()) << "a request through a closed end completed";
      }
      absl::SleepFor(absl::Milliseconds(20));
      EXPECT_EQ(std::count(dst.begin(), dst.end(), 0), 4096) << "bytes landed after the close";
    }
  }
}

// Two engines' worth of TCP transports (no shortcut: over the socket),
// a link between them, and a buffer registered at each end.
struct SocketPair {
  std::unique_ptr<Transport> a, b;
  LinkId ab = 0, ba = 0;  // a's end and b's end of the link
  std::vector<char> at_a, at_b;
  Region ra, rb;
};
std::unique_ptr<SocketPair> MakeSocketPair(size_t buffer_bytes = 1 << 16) {
  auto p = std::make_unique<SocketPair>();
  p->at_a.resize(buffer_bytes);
  p->at_b.resize(buffer_bytes);
  TcpTransportOptions o;
  o.in_process_shortcut = false;
  auto a = CreateTcpTransport(o);
  auto b = CreateTcpTransport(o);
  if (!a.ok() || !b.ok()) return nullptr;
  p->a = std::move(*a);
  p->b = std::move(*b);
  auto links = ConnectInProcess(*p->a, *p->b);
  auto ra = p->a->RegisterMemory(p->at_a.data(), p->at_a.size(), Access::kRemoteWrite);
  auto rb = p->b->RegisterMemory(p->at_b.data(), p->at_b.size(), Access::kRemoteWrite);
  if (!links.ok() || !ra.ok() || !rb.ok()) return nullptr;
  p->ab = links->first;
  p->ba = links->second;
  p->ra = *ra;
  p->rb = *rb;
  return p;
}
// A WRITEs `length` bytes of `fill` from the start of its buffer to
// `offset` in B's and waits for it: the bytes must be there when it
// completes.
void WriteAndWait(SocketPair& p, char fill, uint32_t length = 4096, uint64_t offset = 0) {
  std::fill(p.at_a.begin(), p.at_a.begin() + length, fill);
  WorkRequest w{Opcode::kWrite, p.ab,
                p.ra.id,        p.at_a.data(),
                length,         p.rb.addr + offset,
                p.rb.keys[0],   static_cast<uint64_t>(fill)};
  ASSERT_TRUE(p.a->Post({&w, 1}).ok());
  Completion c;
  ASSERT_EQ(p.a->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
  ASSERT_TRUE(c.status.ok()) << c.status;
  ASSERT_EQ(c.cookie, static_cast<uint64_t>(fill));
  ASSERT_EQ(std::count(p.at_b.begin() + offset, p.at_b.begin() + offset + length, fill), length);
}

// Runs `action` on its own thread `delay` after Go() (or at destruction).
// The thread is made beforehand, so that making it does not hold up the
// caller between its last wait and its next (a link's reader takes its
// turn back after 1 ms with no waiter).
class Later {
 public:
  Later(absl::Duration delay, std::function<void()> action)
      : thread_([this, delay, action = std::move(action)] {
          {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return go_; });
          }
          absl::SleepFor(delay);
          action();
        }) {}
  ~Later() {
    Go();
    thread_.join();
  }
  void Go() {
    std::lock_guard<std::mutex> lock(mu_);
    go_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool go_ = false;
  std::thread thread_;  // last: it starts once the rest is made
};

// A thread that posts and then waits reads its link's acknowledgements
// itself once the link's reader has handed it the turn (its reader then
// parks): every WRITE's bytes are in place when it completes, and every
// acknowledgement counts as the link's input either way.
TEST(TcpWaiterReads, AWaitingThreadReadsItsLinksAcknowledgements) {
  auto p = MakeSocketPair();
  ASSERT_NE(p, nullptr);
  const uint64_t inputs = p->a->InputCount(p->ab);
  for (int i = 0; i < 300; ++i) {
    WriteAndWait(*p, static_cast<char>('a' + i % 26), 4096, (i % 8) * 4096);
    if (HasFatalFailure()) return;
  }
  const TcpWaiterReads reads = GetTcpWaiterReads(*p->a);
  EXPECT_GT(reads.acks, 0u) << "no acknowledgement was read by the waiting thread";
  EXPECT_GT(reads.turns, 0u);
  // Runs of 4 KiB: the waiter polls before it sleeps.
  EXPECT_GT(reads.spins, 0u) << "no waiter polled a link of small runs before sleeping";
  EXPECT_EQ(p->a->InputCount(p->ab) - inputs, 300u);
}

// Runs of requests of more than 256 KiB on average are left to the link's
// reader (a waiter woken by them ran on the peer's CPU and slowed its
// reader): no waiter reads them, however long a thread waits. Each Post is
// 4 WRITEs of 512 KiB (runs of two: 1 MiB at most); every one lands.
TEST(TcpWaiterReads, RunsOfLargeRequestsAreReadByTheLinksReader) {
  auto p = MakeSocketPair(512 << 10);
  ASSERT_NE(p, nullptr);
  const uint32_t length = static_cast<uint32_t>(p->at_a.size());
  for (int i = 0; i < 30; ++i) {
    const char fill = static_cast<char>('a' + i % 26);
    std::fill(p->at_a.begin(), p->at_a.end(), fill);
    std::vector<WorkRequest> run;
    for (uint64_t k = 0; k < 4; ++k) {
      run.push_back(
          {Opcode::kWrite, p->ab, p->ra.id, p->at_a.data(), length, p->rb.addr, p->rb.keys[0], k});
    }
    ASSERT_TRUE(p->a->Post(run).ok());
    for (int got = 0; got < 4;) {
      Completion c[4];
      const size_t n = p->a->WaitCompletions(c, absl::Seconds(5));
      ASSERT_GT(n, 0u) << "a WRITE did not complete in 5 s";
      for (size_t j = 0; j < n; ++j) EXPECT_TRUE(c[j].status.ok()) << c[j].status;
      got += static_cast<int>(n);
    }
    ASSERT_EQ(std::count(p->at_b.begin(), p->at_b.end(), fill), length);
  }
  EXPECT_EQ(GetTcpWaiterReads(*p->a).acks, 0u) << "a waiting thread read a large run's answer";
}

// A run of many smaller requests is read by the waiting thread even when
// the run is large: each Post is 16 WRITEs of 64 KiB (one run of 1 MiB),
// each block its own bytes, stamped with the Post's number. A thread of
// its own waits for the completions all along, as an engine's does (a
// reader parked for a waiter takes its link back after 1 ms without one:
// under ThreadSanitizer a thread that checked and posted between its
// waits outlasted that); the stamps are checked after each Post, and every
// byte after the last.
TEST(TcpWaiterReads, RunsOfSmallRequestsAreReadByTheWaiterEvenWhenLarge) {
  constexpr uint32_t kBlock = 64 << 10;
  constexpr int kBlocks = 16;
  constexpr int kPosts = 100;
  auto p = MakeSocketPair(kBlocks * kBlock);
  ASSERT_NE(p, nullptr);
  for (int k = 0; k < kBlocks; ++k) {
    std::fill_n(p->at_a.begin() + k * kBlock, kBlock, static_cast<char>('a' + k));
  }
  std::mutex mu;
  std::condition_variable cv;
  int completed = 0;  // under mu
  bool failed = false;
  std::thread waiter([&] {
    for (int got = 0; got < kPosts * kBlocks;) {
      Completion c[kBlocks];
      const size_t n = p->a->WaitCompletions(c, absl::Seconds(5));
      bool ok = n > 0;
      for (size_t j = 0; j < n; ++j) ok = ok && c[j].status.ok();
      got += static_cast<int>(n);
      std::lock_guard<std::mutex> lock(mu);
      completed = got;
      failed = failed || !ok;
      cv.notify_all();
      if (failed) return;
    }
  });
  // (No ASSERT before the join: a failure stops posting, and the waiter
  // gives up within 5 s.)
  bool stamps_ok = true;
  for (uint64_t i = 0; i < kPosts && stamps_ok; ++i) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return failed || completed == static_cast<int>(i) * kBlocks; });
      if (failed) break;
    }
    for (int k = 0; i > 0 && k < kBlocks && stamps_ok; ++k) {
      stamps_ok = std::memcmp(p->at_b.data() + k * kBlock, p->at_a.data() + k * kBlock, 16) == 0;
      EXPECT_TRUE(stamps_ok) << "post " << i - 1 << ", block " << k << ": not this Post's bytes";
    }
    std::vector<WorkRequest> run;
    for (uint64_t k = 0; k < kBlocks; ++k) {
      const uint64_t stamp[2] = {i, k};
      std::memcpy(p->at_a.data() + k * kBlock, stamp, sizeof stamp);
      run.push_back({Opcode::kWrite, p->ab, p->ra.id, p->at_a.data() + k * kBlock, kBlock,
                     p->rb.addr + k * kBlock, p->rb.keys[0], k});
    }
    const absl::Status posted = p->a->Post(run);
    EXPECT_TRUE(posted.ok()) << posted;
    if (!posted.ok()) break;
  }
  waiter.join();
  ASSERT_TRUE(stamps_ok && !HasFailure());
  ASSERT_FALSE(failed) << "a WRITE failed or did not complete in 5 s";
  ASSERT_TRUE(p->at_b == p->at_a) << "the bytes at B differ from A's";
  const TcpWaiterReads reads = GetTcpWaiterReads(*p->a);
  EXPECT_GT(reads.acks, 0u) << "no waiting thread read the answer to a run of 64 KiB requests";
  // Runs of 1 MiB take longer than a waiter's polls: it sleeps at once.
  EXPECT_EQ(reads.spins, 0u) << "a waiter polled before sleeping for a run of 1 MiB";
}

// While A's waiting thread has the turn at the link, B's requests on the
// same link still land and are answered while it waits: the waiter gives
// the turn back to the reader (counted), which serves them. Retried until
// the request met a waiting thread with the turn (a matter of timing); the
// bytes must land every time.
TEST(TcpWaiterReads, APeersRequestOnAParkedLinkIsServed) {
  auto p = MakeSocketPair();
  ASSERT_NE(p, nullptr);
  bool handed_back = false;
  for (int round = 0; round < 20 && !handed_back; ++round) {
    Later waiter(absl::ZeroDuration(), [&] {
      Completion c;
      EXPECT_EQ(p->a->WaitCompletions({&c, 1}, absl::Seconds(2)), 0u);
    });
    for (int i = 0; i < 50; ++i) WriteAndWait(*p, 'w');
    if (HasFatalFailure()) return;
    const uint64_t before = GetTcpWaiterReads(*p->a).given_back;
    waiter.Go();
    absl::SleepFor(absl::Milliseconds(20));
    const absl::Time start = absl::Now();
    const char fill = static_cast<char>('A' + round);
    std::fill(p->at_b.begin(), p->at_b.begin() + 1024, fill);
    WorkRequest w{Opcode::kWrite,    p->ba,         p->rb.id, p->at_b.data(), 1024,
                  p->ra.addr + 8192, p->ra.keys[0], 5};
    ASSERT_TRUE(p->b->Post({&w, 1}).ok());
    Completion c;
    ASSERT_EQ(p->b->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
    EXPECT_TRUE(c.status.ok()) << c.status;
    // Served while A's thread still waits, not once it has left.
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    EXPECT_EQ(std::count(p->at_a.begin() + 8192, p->at_a.begin() + 8192 + 1024, fill), 1024);
    handed_back = GetTcpWaiterReads(*p->a).given_back > before;
  }
  EXPECT_TRUE(handed_back) << "no request of the peer ever met a waiter holding the turn";
}

// A thread waiting at a parked link wakes at once for what completes
// elsewhere (another link's acknowledgement) and for InterruptWait, not at
// the end of its timeout.
TEST(TcpWaiterReads, AWaiterAtAParkedLinkWakesForOtherCompletionsAndInterrupts) {
  auto p = MakeSocketPair();
  ASSERT_NE(p, nullptr);
  TcpTransportOptions o;
  o.in_process_shortcut = false;
  auto c3 = CreateTcpTransport(o);
  ASSERT_TRUE(c3.ok());
  auto other = ConnectInProcess(*p->a, **c3);
  ASSERT_TRUE(other.ok()) << other.status();
  std::vector<char> at_c(4096);
  auto rc = (*c3)->RegisterMemory(at_c.data(), at_c.size(), Access::kRemoteWrite);
  ASSERT_TRUE(rc.ok());
  bool polled_other = false, polled_interrupt = false;
  for (int round = 0; round < 20 && !(polled_other && polled_interrupt); ++round) {
    // Another link's WRITE, posted while this thread waits.
    Later poster(absl::Milliseconds(20), [&] {
      WorkRequest w{Opcode::kWrite, other->first, p->ra.id,    p->at_a.data(),
                    4096,           rc->addr,     rc->keys[0], 9};
      EXPECT_TRUE(p->a->Post({&w, 1}).ok());
    });
    Later interrupter(absl::Milliseconds(20), [&] { p->a->InterruptWait(); });
    for (int i = 0; i < 50; ++i) WriteAndWait(*p, 'x');
    if (HasFatalFailure()) return;
    uint64_t turns = GetTcpWaiterReads(*p->a).turns;
    poster.Go();
    absl::Time start = absl::Now();
    Completion c;
    EXPECT_EQ(p->a->WaitCompletions({&c, 1}, absl::Seconds(20)), 1u);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_EQ(c.cookie, 9u);
    polled_other = polled_other || GetTcpWaiterReads(*p->a).turns > turns;
    // InterruptWait from another thread.
    for (int i = 0; i < 50; ++i) WriteAndWait(*p, 'y');
    if (HasFatalFailure()) return;
    turns = GetTcpWaiterReads(*p->a).turns;
    interrupter.Go();
    start = absl::Now();
    EXPECT_EQ(p->a->WaitCompletions({&c, 1}, absl::Seconds(20)), 0u);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    polled_interrupt = polled_interrupt || GetTcpWaiterReads(*p->a).turns > turns;
  }
  EXPECT_TRUE(polled_other && polled_interrupt)
      << "the waits never found the link parked: " << polled_other << polled_interrupt;
}

// The peer's end closes while this end's waiting thread has the turn: the
// waiter gives the turn back with the connection's end, the reader fails
// the link, and a WRITE posted on it then fails (or is refused) at once.
TEST(TcpWaiterReads, ThePeersCloseFailsTheRequestAWaiterWaitsFor) {
  bool met_waiter = false;
  for (int round = 0; round < 20 && !met_waiter; ++round) {
    auto p = MakeSocketPair();
    ASSERT_NE(p, nullptr);
    // B's end closes while A's thread waits at the link.
    Later closer(absl::Milliseconds(20), [&] { EXPECT_TRUE(p->b->CloseLink(p->ba).ok()); });
    for (int i = 0; i < 50; ++i) WriteAndWait(*p, 'z');
    if (HasFatalFailure()) return;
    const TcpWaiterReads before = GetTcpWaiterReads(*p->a);
    closer.Go();
    const absl::Time start = absl::Now();
    Completion c;
    // Nothing is outstanding: the wait ends at its timeout; then a WRITE
    // on the link fails.
    (void)p->a->WaitCompletions({&c, 1}, absl::Milliseconds(200));
    const TcpWaiterReads after = GetTcpWaiterReads(*p->a);
    met_waiter = after.given_back > before.given_back && after.turns > before.turns;
    WorkRequest w{Opcode::kWrite, p->ab,      p->ra.id,      p->at_a.data(),
                  4096,           p->rb.addr, p->rb.keys[0], 3};
    const absl::Status posted = p->a->Post({&w, 1});
    if (posted.ok()) {
      ASSERT_EQ(p->a->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
      EXPECT_FALSE(c.status.ok());
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  EXPECT_TRUE(met_waiter) << "the close never met a waiter holding the turn";
}

TEST(TcpTransport, WildcardBindNeedsAnAdvertisedAddress) {
  TcpTransportOptions o;
  o.bind_host = "0.0.0.0";
  EXPECT_EQ(CreateTcpTransport(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.advertise_host = "127.0.0.1";
  auto t = CreateTcpTransport(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->LocalEndpoint().nics[0].address.rfind("127.0.0.1:", 0), 0u);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
