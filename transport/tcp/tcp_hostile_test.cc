// The TCP data port against a peer that misbehaves after pairing: a peer
// stalled in the middle of a WRITE holds no lock (others register,
// unregister and transfer meanwhile; unregistering the region it writes
// into ends its link within the grace period), and a zero-length request
// must name a valid key like any other.
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "net/socket.h"
#include "transport/in_process.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace {

using tcp_wire::DataHeader;

// A raw peer paired with `t` through the real handshake steps (hello, then
// AcceptLink with its token); speaks the wire format by hand.
net::Fd PairRawPeer(Transport& t) {
  const std::string address = t.LocalEndpoint().nics[0].address;
  auto hp = net::ParseHostPort(address);
  EXPECT_TRUE(hp.ok());
  auto fd = net::Connect(*hp, absl::Seconds(2));
  EXPECT_TRUE(fd.ok());
  const uint64_t token = 0x5eed5eed;
  char hello[kHelloBytes];
  std::memcpy(hello, &kHelloMagic, 8);
  std::memcpy(hello + 8, &token, 8);
  EXPECT_TRUE(net::WriteFull(fd->get(), hello, sizeof hello, absl::Now() + absl::Seconds(2)).ok());
  auto offer = t.AcceptLink(0, NicInfo{}, tcp_wire::EncodeLinkParams(token, 0, 0));
  EXPECT_TRUE(offer.ok()) << offer.status();
  return std::move(*fd);
}

// A WRITE request of `length` bytes into region `r`, acknowledged at once.
DataHeader WriteHeader(const Region& r, uint64_t length) {
  DataHeader h;
  h.type = tcp_wire::kWriteReq;
  h.flags = tcp_wire::kAckNow;
  h.id = 1;
  h.remote_addr = r.addr;
  h.rkey = r.keys[0];
  h.length = length;
  return h;
}

// True when the transport has shut `fd`'s connection down within `within`.
bool Closed(int fd, absl::Duration within) {
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(within)) + 1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[256];
  const absl::Time deadline = absl::Now() + within;
  while (absl::Now() < deadline) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return n == 0 || errno == ECONNRESET;
  }
  return false;
}

TEST(TcpHostile, APeerStalledMidWriteHoldsNoLock) {
  TcpTransportOptions o;
  o.in_process_shortcut = false;  // the legitimate WRITE goes over the socket too
  auto b = CreateTcpTransport(o);
  auto a = CreateTcpTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<char> target(1 << 20, 0), other(4096, 0), third(4096, 0), src(4096, 's');
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  auto r2 = (*b)->RegisterMemory(other.data(), other.size(), Access::kRemoteWrite);
  auto r3 = (*b)->RegisterMemory(third.data(), third.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok() && r2.ok() && r3.ok());

  net::Fd stalled = PairRawPeer(**b);
  const DataHeader h = WriteHeader(*r, target.size());
  ASSERT_TRUE(net::WriteFull(stalled.get(), &h, sizeof h, absl::Now() + absl::Seconds(2)).ok());
  ASSERT_TRUE(net::WriteFull(stalled.get(), src.data(), 1000, absl::Now() + absl::Seconds(2)).ok());
  absl::SleepFor(absl::Milliseconds(50));  // the responder is now inside the WRITE's bytes

  // Unregistering another region does not wait for the stalled peer.
  absl::Time start = absl::Now();
  ASSERT_TRUE((*b)->UnregisterMemory(r3->id).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));

  // A legitimate peer's WRITE completes meanwhile.
  auto links = ConnectInProcess(**a, **b);
  ASSERT_TRUE(links.ok()) << links.status();
  auto rs = (*a)->RegisterMemory(src.data(), src.size(), Access::kNone);
  ASSERT_TRUE(rs.ok());
  WorkRequest w{Opcode::kWrite, links->first, rs->id,      src.data(),
                src.size(),     r2->addr,     r2->keys[0], 7};
  ASSERT_TRUE((*a)->Post({&w, 1}).ok());
  Completion c;
  ASSERT_EQ((*a)->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
  EXPECT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(other, src);

  // Unregistering the region it writes into ends its link after the grace
  // period instead of waiting forever.
  start = absl::Now();
  ASSERT_TRUE((*b)->UnregisterMemory(r->id).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_TRUE(Closed(stalled.get(), absl::Seconds(2)));
}

// A region unregistered while a peer's WRITE into it is under way: the
// WRITE finishes and lands, UnregisterMemory returns once it has (not at
// the grace period's end), and the next WRITE into the region, right
// behind it, is refused and lands nothing.
TEST(TcpHostile, AWriteUnderWayFinishesAndTheNextIsRefusedOnceUnregistered) {
  auto b = CreateTcpTransport({});
  ASSERT_TRUE(b.ok());
  std::vector<char> target(1 << 20, 0), src(64 << 10, 's');
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok());
  net::Fd peer = PairRawPeer(**b);
  const absl::Time soon = absl::Now() + absl::Seconds(2);
  // The first WRITE's header and part of its bytes: the responder now holds
  // the region, inside the WRITE.
  const DataHeader first = WriteHeader(*r, src.size());
  ASSERT_TRUE(net::WriteFull(peer.get(), &first, sizeof first, soon).ok());
  ASSERT_TRUE(net::WriteFull(peer.get(), src.data(), 1000, soon).ok());
  absl::SleepFor(absl::Milliseconds(50));

  absl::Time unregistered;
  const absl::Time start = absl::Now();
  std::thread unregister([&] {
    EXPECT_TRUE((*b)->UnregisterMemory(r->id).ok());
    unregistered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(100));  // it waits for the WRITE under way
  // The rest of the first WRITE, and a second one into the same region right
  // behind it, read in one go with the first's end.
  DataHeader second = WriteHeader(*r, 4096);
  second.id = 2;
  second.remote_addr = r->addr + (256 << 10);
  ASSERT_TRUE(net::WriteFull(peer.get(), src.data() + 1000, src.size() - 1000, soon).ok() &&
              net::WriteFull(peer.get(), &second, sizeof second, soon).ok() &&
              net::WriteFull(peer.get(), src.data(), 4096, soon).ok());
  unregister.join();
  // Not the grace period's end: the first WRITE finished and let it go.
  EXPECT_LT(unregistered - start, absl::Milliseconds(900));
  EXPECT_TRUE(std::all_of(target.begin(), target.begin() + src.size(), [](char c) {
    return c == 's';
  })) << "the WRITE under way when the region was unregistered did not land";
  EXPECT_TRUE(std::all_of(target.begin() + (256 << 10), target.begin() + (256 << 10) + 4096,
                          [](char c) { return c == 0; }))
      << "a WRITE into an unregistered region landed";
  DataHeader answer;
  ASSERT_TRUE(net::ReadFull(peer.get(), &answer, sizeof answer, soon).ok());
  EXPECT_EQ(answer.status, 0) << "the first WRITE was not acknowledged";
  ASSERT_TRUE(net::ReadFull(peer.get(), &answer, sizeof answer, soon).ok());
  EXPECT_EQ(answer.id, 2u);
  EXPECT_NE(answer.status, 0) << "a WRITE into an unregistered region was acknowledged";
  EXPECT_TRUE(Closed(peer.get(), absl::Seconds(2)));
}

// A link waiting for its peer's next request holds no region: unregistering
// the region its last WRITE went into neither waits for the grace period
// nor ends the link.
TEST(TcpHostile, AnIdleLinkHoldsNoRegion) {
  auto b = CreateTcpTransport({});
  ASSERT_TRUE(b.ok());
  std::vector<char> target(64 << 10, 0), other(4096, 0), src(4096, 's');
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  auto r2 = (*b)->RegisterMemory(other.data(), other.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok() && r2.ok());
  net::Fd peer = PairRawPeer(**b);
  const absl::Time soon = absl::Now() + absl::Seconds(2);
  DataHeader h = WriteHeader(*r, src.size());
  DataHeader answer;
  ASSERT_TRUE(net::WriteFull(peer.get(), &h, sizeof h, soon).ok() &&
              net::WriteFull(peer.get(), src.data(), src.size(), soon).ok() &&
              net::ReadFull(peer.get(), &answer, sizeof answer, soon).ok());
  ASSERT_EQ(answer.status, 0);

  const absl::Time start = absl::Now();
  ASSERT_TRUE((*b)->UnregisterMemory(r->id).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  // The link still serves.
  h = WriteHeader(*r2, src.size());
  h.id = 2;
  ASSERT_TRUE(net::WriteFull(peer.get(), &h, sizeof h, soon).ok() &&
              net::WriteFull(peer.get(), src.data(), src.size(), soon).ok());
  ASSERT_TRUE(net::ReadFull(peer.get(), &answer, sizeof answer, soon).ok());
  EXPECT_EQ(answer.status, 0);
  EXPECT_EQ(other, src);
}

// AcceptLink never waits for the link's connection: a link accepted before
// its hello arrives is attached when it does and serves; one whose
// connection never comes ends after the connect timeout (counted).
TEST(TcpHostile, ALinkAcceptedBeforeItsConnectionServesOnceItArrives) {
  TcpTransportOptions o;
  o.connect_timeout = absl::Seconds(1);
  auto b = CreateTcpTransport(o);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE((*b)->GetLimits().accept_waits);
  std::vector<char> target(4096, 0), src(4096, 'h');
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok());
  const uint64_t token = 0xacce97;
  auto offer = (*b)->AcceptLink(0, NicInfo{}, tcp_wire::EncodeLinkParams(token, 0, 0));
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_TRUE((*b)->HasLink(offer->link));
  auto never = (*b)->AcceptLink(0, NicInfo{}, tcp_wire::EncodeLinkParams(token + 1, 0, 0));
  ASSERT_TRUE(never.ok()) << never.status();
  // Either end may post on a link: on one still waiting for its connection
  // the request waits too, and fails when the connection never comes.
  std::vector<char> spare(64, 's');
  auto rs = (*b)->RegisterMemory(spare.data(), spare.size(), Access::kNone);
  ASSERT_TRUE(rs.ok());
  WorkRequest stranded{Opcode::kWrite, never->link, rs->id, spare.data(),
                       spare.size(),   0x1000,      1,      77};
  ASSERT_TRUE((*b)->Post({&stranded, 1}).ok());

  auto hp = net::ParseHostPort((*b)->LocalEndpoint().nics[0].address);
  ASSERT_TRUE(hp.ok());
  auto fd = net::Connect(*hp, absl::Seconds(2));
  ASSERT_TRUE(fd.ok());
  const std::string hello = EncodeHello(token, "");
  ASSERT_TRUE(
      net::WriteFull(fd->get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(2)).ok());
  const DataHeader h = WriteHeader(*r, src.size());
  ASSERT_TRUE(net::WriteFull(fd->get(), &h, sizeof h, absl::Now() + absl::Seconds(2)).ok());
  ASSERT_TRUE(
      net::WriteFull(fd->get(), src.data(), src.size(), absl::Now() + absl::Seconds(2)).ok());
  DataHeader answer;
  ASSERT_TRUE(
      net::ReadFull(fd->get(), &answer, sizeof answer, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(answer.type, tcp_wire::kWriteAck);
  EXPECT_EQ(answer.status, 0);
  EXPECT_EQ(target, src);

  // The other one's connection never comes: it ends, and is counted.
  auto never_came = [&] {
    for (const auto& [reason, count] : (*b)->RefusedInput()) {
      if (reason == "data_connection_never_came") return count;
    }
    return uint64_t{0};
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while ((never_came() == 0 || (*b)->HasLink(never->link)) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(never_came(), 1u);
  EXPECT_FALSE((*b)->HasLink(never->link));
  EXPECT_TRUE((*b)->HasLink(offer->link));
  Completion c;
  ASSERT_EQ((*b)->WaitCompletions({&c, 1}, absl::Seconds(5)), 1u);
  EXPECT_EQ(c.cookie, 77u);
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
}

TEST(TcpHostile, AZeroLengthRequestMustNameAValidKey) {
  auto b = CreateTcpTransport({});
  ASSERT_TRUE(b.ok());
  std::vector<char> target(4096, 0);
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok());
  net::Fd peer = PairRawPeer(**b);
  DataHeader h;
  h.type = tcp_wire::kWriteReq;
  h.flags = tcp_wire::kAckNow;
  h.id = 1;
  h.remote_addr = r->addr;
  h.rkey = r->keys[0] ^ 0xdead;  // a guessed key
  h.length = 0;
  ASSERT_TRUE(net::WriteFull(peer.get(), &h, sizeof h, absl::Now() + absl::Seconds(2)).ok());
  DataHeader answer;
  ASSERT_TRUE(
      net::ReadFull(peer.get(), &answer, sizeof answer, absl::Now() + absl::Seconds(2)).ok());
  EXPECT_EQ(answer.type, tcp_wire::kWriteAck);
  EXPECT_NE(answer.status, 0) << "a zero-length request with a wrong key was acknowledged";
}

// Links the transport dropped because their peer read none of its answers.
uint64_t DroppedLinks(Transport& t) {
  for (const auto& [name, count] : t.RefusedInput()) {
    if (name == "data_peer_dropped_unread_answers") return count;
  }
  return 0;
}

// Sends [data, +size) to a peer that reads nothing back, without blocking:
// while the socket takes no more, tries again every 1 ms, until all of it
// is sent, the transport dropped a link, or the deadline. False when the
// connection failed.
bool SendWhileKept(int fd, const char* data, size_t size, Transport& t, absl::Time deadline) {
  while (size > 0 && absl::Now() < deadline) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return false;
    } else if (DroppedLinks(t) > 0) {
      return true;
    } else {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  return true;
}

// A peer that sends requests and never reads the answers loses its link
// once more answers wait than a legitimate peer could leave unanswered;
// the responder does not queue them without bound.
TEST(TcpHostile, APeerThatNeverReadsItsAnswersIsDropped) {
  TcpTransportOptions o;
  o.max_outstanding_per_link = 16;
  auto b = CreateTcpTransport(o);
  ASSERT_TRUE(b.ok());
  std::vector<char> target(4096, 0);
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok());
  net::Fd peer = PairRawPeer(**b);
  const int small = 4096;
  ::setsockopt(peer.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  DataHeader h;
  h.type = tcp_wire::kWriteReq;
  h.flags = tcp_wire::kAckNow;
  h.remote_addr = r->addr;
  h.rkey = r->keys[0];
  h.length = 0;
  std::vector<DataHeader> burst(1024, h);
  // The peer sends on and never reads, not even while it waits: reading
  // (as a close would need, the FIN queued behind the unread answers) let
  // the responder's writer go on, and its queue sometimes never grew past
  // the bound before the requests ran out (seen once under load).
  bool closed = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  for (uint64_t id = 1; !closed && DroppedLinks(**b) == 0 && absl::Now() < deadline;) {
    for (auto& each : burst) each.id = id++;
    closed = !SendWhileKept(peer.get(), reinterpret_cast<const char*>(burst.data()),
                            burst.size() * sizeof h, **b, deadline);
  }
  // Dropped by the answer queue's bound (counted before the link closes).
  EXPECT_EQ(DroppedLinks(**b), 1u) << "the responder kept the link of a peer that reads no answers";
}

// The same with WRITEs of 16 KiB, each its own Post: their acknowledgements
// are the ones the reader sends itself even with requests buffered behind
// them. They wait in the socket (bounded by its send buffer) or, once it
// takes no more, behind the writer (bounded as above); either way the peer
// loses its link in bounded time: by the answer queue's bound, or when the
// unread acknowledgements outlast dead_peer_timeout.
TEST(TcpHostile, APeerThatNeverReadsTheAcksOfLargeWritesLosesItsLink) {
  constexpr uint32_t kBlock = 16 << 10;
  // Made before the transport: its reader may still write into `target`
  // until the transport is gone.
  std::vector<char> target(kBlock, 0);
  TcpTransportOptions o;
  o.max_outstanding_per_link = 16;
  o.dead_peer_timeout = absl::Seconds(2);
  auto b = CreateTcpTransport(o);
  ASSERT_TRUE(b.ok());
  auto r = (*b)->RegisterMemory(target.data(), target.size(), Access::kRemoteWrite);
  ASSERT_TRUE(r.ok());
  net::Fd peer = PairRawPeer(**b);
  const int small = 4096;
  ::setsockopt(peer.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  DataHeader h;
  h.type = tcp_wire::kWriteReq;
  h.flags = tcp_wire::kAckNow;
  h.remote_addr = r->addr;
  h.rkey = r->keys[0];
  h.length = kBlock;
  std::vector<char> message(sizeof h + kBlock, 'w');  // the header, then the payload
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  bool closed = false;
  for (uint64_t id = 1; !closed && DroppedLinks(**b) == 0 && absl::Now() < deadline; ++id) {
    h.id = id;
    std::memcpy(message.data(), &h, sizeof h);
    closed = !SendWhileKept(peer.get(), message.data(), message.size(), **b, deadline);
  }
  EXPECT_TRUE(closed || DroppedLinks(**b) == 1u)
      << "the responder kept for 20 s the link of a peer that reads no answers";
}

// Links are capped: a peer cannot make the transport hold (and run two
// threads for) links without bound.
TEST(TcpHostile, LinksAreCapped) {
  TcpTransportOptions o;
  o.max_links = 2;
  o.connect_timeout = absl::Milliseconds(500);
  auto b = CreateTcpTransport(o);
  auto a = CreateTcpTransport({});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(ConnectInProcess(**a, **b).ok());
  EXPECT_TRUE(ConnectInProcess(**a, **b).ok());
  auto third = ConnectInProcess(**a, **b);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
