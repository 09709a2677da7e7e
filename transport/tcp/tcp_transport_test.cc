// TCP-specific behaviour beyond the conformance suite.
#include "transport/tcp/tcp_transport.h"

#include <dirent.h>
#include <sys/socket.h>

#include <algorithm>
#include <memory>
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
