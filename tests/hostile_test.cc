// An engine in its own process under a combined attack on loopback, at the
// handshake port and the TCP data port at once:
//   - 1,000 idle connections,
//   - 100 slowloris connections (a few bytes of a frame, then silence),
//   - 50 connections claiming 16 MiB frames and 50 that claim 1 MiB and send
//     64 KiB of it,
//   - 100 data-port connections that never say hello.
// During the attack a legitimate client's handshake plus first 4 KiB WRITE
// completes (the ratio of its median time to the unloaded median is printed;
// the test fails only at 10x, a wedged or serialised server, since timings
// on shared machines are noisy), the engine's RSS grows by under 64 MiB, and
// after the attackers leave it serves as before. Bounded: every loop has a
// fixed count, every wait a deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "handshake/messages.h"
#include "handshake/tcp_network.h"
#include "net/socket.h"
#include "tests/peer_process.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

void RaiseDescriptorLimit() {
  rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }
}

// The number in /proc/<pid>/status's line `field` (0 when unreadable).
uint64_t StatusField(pid_t pid, const std::string& field) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) {
      std::string value = line.substr(field.size());
      if (absl::EndsWith(value, "kB")) value.resize(value.size() - 2);
      uint64_t n = 0;
      (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(value), &n);
      return n;
    }
  }
  return 0;
}

// The resident set of `pid` in KiB (0 when unreadable).
uint64_t RssKiB(pid_t pid) { return StatusField(pid, "VmRSS:"); }
uint64_t Threads(pid_t pid) { return StatusField(pid, "Threads:"); }

// A fresh client engine's handshake and first 4 KiB WRITE to `peer`;
// returns how long they took (infinite on failure).
absl::Duration LegitimateFirstTransfer(const std::string& peer) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  auto engine = TransferEngine::Create(o);
  if (!engine.ok()) return absl::InfiniteDuration();
  std::vector<char> src(4096, 'L');
  if (!(*engine)->RegisterMemory(src.data(), src.size(), transport::Access::kNone).ok()) {
    return absl::InfiniteDuration();
  }
  const absl::Time start = absl::Now();
  auto seg = (*engine)->OpenSegment(peer);
  if (!seg.ok()) {
    ADD_FAILURE() << seg.status();
    return absl::InfiniteDuration();
  }
  auto regions = (*engine)->SegmentRegions(*seg);
  if (!regions.ok() || regions->empty()) return absl::InfiniteDuration();
  TransferRequest w{transport::Opcode::kWrite, src.data(), (*regions)[0].addr, src.size()};
  auto batch = (*engine)->Submit(*seg, {&w, 1});
  auto st = batch.ok() ? (*engine)->Wait(*batch, absl::Seconds(10))
                       : absl::StatusOr<BatchStatus>(batch.status());
  const absl::Duration took = absl::Now() - start;
  if (!st.ok() || !st->ok()) {
    ADD_FAILURE() << (st.ok() ? st->requests[0] : st.status());
    return absl::InfiniteDuration();
  }
  return took;
}

absl::Duration Median(const std::string& peer, int rounds) {
  std::vector<absl::Duration> t;
  for (int i = 0; i < rounds; ++i) t.push_back(LegitimateFirstTransfer(peer));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The peer's TCP data port, from its descriptor.
std::string DataAddress(const std::string& peer) {
  auto reply = handshake::NewTcpNetwork()->Call(
      peer, handshake::Frame{handshake::MessageType::kDescribe, ""}, absl::Seconds(5));
  if (!reply.ok()) return "";
  auto d = handshake::DecodeDescriptor(reply->payload);
  return d.ok() && !d->nics.empty() ? d->nics[0].address : "";
}

std::vector<net::Fd> Open(const std::string& address, int count) {
  std::vector<net::Fd> out;
  auto hp = net::ParseHostPort(address);
  if (!hp.ok()) return out;
  for (int i = 0; i < count; ++i) {
    auto fd = net::Connect(*hp, absl::Seconds(2));
    if (fd.ok()) out.push_back(std::move(*fd));
  }
  return out;
}

void SendEach(std::vector<net::Fd>& fds, const std::string& bytes) {
  for (net::Fd& fd : fds) (void)::send(fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
}

// Sends `bytes` on `fd` with a send timeout of 2 s; false when it could
// not (the server closed the connection, or stopped reading).
bool SendWithin(net::Fd& fd, const std::string& bytes) {
  timeval tv{2, 0};
  (void)::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd.get(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

// Pre-auth starvation: 32 connections each send the header of an
// authenticated frame that claims 1,110,016 bytes, then the rest of 1 MiB,
// and hold it; the attacker replaces every connection the engine closes, for as
// long as the test runs. The server's buffer budget (32 MiB) is the target:
// an engine that closes whichever connection reads next when the budget is
// full starves everyone else. Under the attack a legitimate client holding
// the secret completes its handshake (challenge and authenticated frames)
// and a WRITE, five times over.
TEST(Hostile, PreAuthStarvationLeavesAPeerWithTheSecretServed) {
  RaiseDescriptorLimit();
  ASSERT_EQ(::setenv("KVFERRY_SECRET", "hostile-test-secret-0123456789", 1), 0);
  auto peer = PeerProcess::Start(0, 1 << 20);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_LT(LegitimateFirstTransfer(peer->address()), absl::Seconds(10));

  std::string hog = handshake::EncodeFrame(handshake::MessageType::kAuthenticated, "");
  const uint32_t claim = 1110016;
  std::memcpy(&hog[4], &claim, 4);
  hog += std::string((1 << 20) - hog.size(), 'x');  // 1 MiB in all: 32 fill the budget
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> hogs_sent{0};
  std::thread attacker([&] {
    std::vector<net::Fd> conns;
    while (!stop) {
      // Replace the connections the engine closed (a closed one fails to
      // take more bytes, or reads as closed).
      for (size_t i = 0; i < conns.size();) {
        char b;
        const ssize_t n = ::recv(conns[i].get(), &b, 1, MSG_DONTWAIT | MSG_PEEK);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) || n > 0) {
          conns.erase(conns.begin() + i);
        } else {
          ++i;
        }
      }
      std::vector<net::Fd> fresh = Open(peer->address(), 32 - static_cast<int>(conns.size()));
      for (net::Fd& fd : fresh) {
        if (stop) break;
        if (SendWithin(fd, hog)) ++hogs_sent;
        conns.push_back(std::move(fd));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  absl::SleepFor(absl::Seconds(1));  // the budget is full
  int served = 0;
  for (int i = 0; i < 5; ++i) {
    if (LegitimateFirstTransfer(peer->address()) < absl::Seconds(10)) ++served;
  }
  stop = true;
  attacker.join();
  std::printf("hogs sent: %lu MiB\n", static_cast<unsigned long>(hogs_sent.load()));
  EXPECT_GE(hogs_sent.load(), 32u);  // the attack ran
  EXPECT_EQ(served, 5);
  ::unsetenv("KVFERRY_SECRET");
}

// A connection to `peer` from source address `from` (another loopback
// address: a second host, as the engine's per-source shares see it).
// PeerService::kMaxLinksPerSource (engine/peer/peer_service.h), which this
// test cannot include: the links one source address may hold.
constexpr size_t PeerServiceShare() { return 128; }

net::Fd ConnectFrom(const std::string& from, const std::string& peer) {
  auto hp = net::ParseHostPort(peer);
  if (!hp.ok()) return net::Fd();
  net::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &a.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return net::Fd();
  sockaddr_in b{};
  b.sin_family = AF_INET;
  b.sin_port = htons(hp->port);
  ::inet_pton(AF_INET, hp->host.c_str(), &b.sin_addr);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&b), sizeof b) != 0) return net::Fd();
  return fd;
}

// Sends `request` as a connect-links frame from `source` and reads the
// reply.
absl::StatusOr<handshake::ConnectLinksReply> ConnectLinksFrom(
    const char* source, const std::string& to, const handshake::ConnectLinksRequest& request,
    net::Fd* keep = nullptr) {
  net::Fd fd = ConnectFrom(source, to);
  if (!fd.valid()) return absl::UnavailableError(absl::StrCat("cannot connect from ", source));
  const std::string f =
      handshake::EncodeFrame(handshake::MessageType::kConnectLinks, handshake::Encode(request));
  RETURN_IF_ERROR(net::WriteFull(fd.get(), f.data(), f.size(), absl::Now() + absl::Seconds(5)));
  std::string head(handshake::kFrameHeaderBytes, '\0');
  RETURN_IF_ERROR(
      net::ReadFull(fd.get(), head.data(), head.size(), absl::Now() + absl::Seconds(10)));
  ASSIGN_OR_RETURN(handshake::FrameHeader h, handshake::ParseFrameHeader(head, 1 << 20));
  if (h.type != handshake::MessageType::kConnectLinksReply) {
    return absl::DataLossError("not a connect-links reply");
  }
  std::string payload(h.payload_bytes, '\0');
  RETURN_IF_ERROR(
      net::ReadFull(fd.get(), payload.data(), payload.size(), absl::Now() + absl::Seconds(10)));
  if (keep != nullptr) *keep = std::move(fd);
  return handshake::DecodeConnectLinksReply(payload);
}

// A claim flood from one source (no secret needed): eight connect-links
// requests of 64 links each, with made-up tokens whose data connections
// never come. Each accepted link holds a claim on the data port (256 in
// all) until its connect timeout: before the per-source share, four such
// requests refused every other peer's links. Now the source gets its share
// (PeerService::kMaxLinksPerSource) and a legitimate peer from another
// address completes its handshake and a WRITE.
TEST(Hostile, AClaimFloodFromOneSourceLeavesOthersTheirLinks) {
  RaiseDescriptorLimit();
  ::unsetenv("KVFERRY_SECRET");
  auto peer = PeerProcess::Start(0, 1 << 20);
  ASSERT_TRUE(peer.ok()) << peer.status();
  handshake::ConnectLinksRequest bogus;
  for (int i = 0; i < 64; ++i) {
    bogus.links.push_back(
        handshake::ConnectRequest{0xbad,
                                  0,
                                  {"lo", "127.0.0.3:1", 0, 0, 0},
                                  0,
                                  transport::tcp_wire::EncodeLinkParams(0x1000 + i, 0, 0)});
  }
  std::vector<net::Fd> flood;
  size_t accepted = 0, refused = 0;
  for (int r = 0; r < 8; ++r) {
    for (size_t i = 0; i < bogus.links.size(); ++i) {  // fresh tokens each round
      bogus.links[i].params = transport::tcp_wire::EncodeLinkParams(0x10000 * (r + 1) + i, 0, 0);
    }
    net::Fd fd;
    auto answers = ConnectLinksFrom("127.0.0.3", peer->address(), bogus, &fd);
    ASSERT_TRUE(answers.ok()) << answers.status();
    for (const auto& a : answers->links) {
      (a.ok() ? accepted : refused)++;
      if (!a.ok() && refused == 1)
        std::printf("first refusal: %s\n", a.status().ToString().c_str());
    }
    flood.push_back(std::move(fd));
  }
  std::printf("claim flood: %zu links accepted, %zu refused\n", accepted, refused);
  EXPECT_LE(accepted, 128u);
  EXPECT_GT(refused, 0u);
  // A peer from another address is served meanwhile.
  EXPECT_LT(LegitimateFirstTransfer(peer->address()), absl::Seconds(5));
  // The claims expire within claim_wait (2 s) and a sweep, not the 5 s
  // connect timeout: the flooding source has its whole share again.
  absl::SleepFor(absl::Milliseconds(2500));
  size_t again = 0;
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < bogus.links.size(); ++i) {
      bogus.links[i].params =
          transport::tcp_wire::EncodeLinkParams(0x900000 + 0x1000 * r + i, 0, 0);
    }
    auto answers = ConnectLinksFrom("127.0.0.3", peer->address(), bogus);
    ASSERT_TRUE(answers.ok()) << answers.status();
    for (const auto& a : answers->links) again += a.ok();
  }
  std::printf("claim flood, 2.5 s later: %zu of 128 links accepted\n", again);
  EXPECT_EQ(again, 128u);
}

// A link flood from one source: 512 real links (each with its data
// connection and hello, no secret needed) asked for from 127.0.0.3. Before
// the per-source share, 512 links took the victim to 1,029 threads and
// refused everyone else. Now the source gets its share
// (PeerService::kMaxLinksPerSource, 128 links: 256 link threads), the
// rest are refused, and a peer from another address is served.
TEST(Hostile, ALinkFloodFromOneSourceGetsItsShareAndThreadsStayBounded) {
  RaiseDescriptorLimit();
  ::unsetenv("KVFERRY_SECRET");
  auto peer = PeerProcess::Start(0, 1 << 20);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string data = DataAddress(peer->address());
  ASSERT_FALSE(data.empty());
  const uint64_t threads_before = Threads(peer->pid());
  std::vector<net::Fd> held;  // every connection stays open
  size_t accepted = 0, refused = 0;
  for (uint64_t r = 0; r < 8; ++r) {
    handshake::ConnectLinksRequest request;
    for (uint64_t i = 0; i < 64; ++i) {
      const uint64_t token = 0x5000000 + r * 64 + i;
      net::Fd c = ConnectFrom("127.0.0.3", data);
      ASSERT_TRUE(c.valid()) << "cannot connect from 127.0.0.3";
      const std::string hello = transport::EncodeHello(token, "");
      ASSERT_TRUE(
          net::WriteFull(c.get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(5)).ok());
      held.push_back(std::move(c));
      request.links.push_back(
          handshake::ConnectRequest{0xf100d,
                                    0,
                                    {"lo", "127.0.0.3:1", 0, 0, 0},
                                    0,
                                    transport::tcp_wire::EncodeLinkParams(token, 0, 0)});
    }
    net::Fd h;
    auto answers = ConnectLinksFrom("127.0.0.3", peer->address(), request, &h);
    ASSERT_TRUE(answers.ok()) << answers.status();
    for (const auto& a : answers->links) (a.ok() ? accepted : refused)++;
    held.push_back(std::move(h));
  }
  absl::SleepFor(absl::Milliseconds(300));  // every accepted link's threads are up
  const uint64_t threads = Threads(peer->pid());
  std::printf("link flood: %zu links accepted, %zu refused; victim threads %d -> %d\n", accepted,
              refused, static_cast<int>(threads_before), static_cast<int>(threads));
  EXPECT_EQ(accepted + refused, 512u);
  EXPECT_LE(accepted, PeerServiceShare());
  EXPECT_GE(accepted, 64u);  // the share is given, not refused outright
  EXPECT_LE(threads, threads_before + 2 * PeerServiceShare() + 16);
  // A peer from another address is served meanwhile.
  EXPECT_LT(LegitimateFirstTransfer(peer->address()), absl::Seconds(5));
}

TEST(Hostile, CombinedAttackLeavesLegitimateTrafficAndMemoryBounded) {
  RaiseDescriptorLimit();
  auto peer = PeerProcess::Start(0, 1 << 20);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string data = DataAddress(peer->address());
  ASSERT_FALSE(data.empty());

  (void)LegitimateFirstTransfer(peer->address());  // warm both sides up
  const absl::Duration unloaded = Median(peer->address(), 7);
  const uint64_t rss_before = RssKiB(peer->pid());
  ASSERT_GT(rss_before, 0u);

  std::vector<net::Fd> idle = Open(peer->address(), 1000);
  std::vector<net::Fd> slow = Open(peer->address(), 100);
  std::vector<net::Fd> huge = Open(peer->address(), 50);
  std::vector<net::Fd> big = Open(peer->address(), 50);
  std::vector<net::Fd> silent_data = Open(data, 100);
  EXPECT_GE(idle.size() + slow.size() + huge.size() + big.size() + silent_data.size(), 1200u);
  std::string header = handshake::EncodeFrame(handshake::MessageType::kNotify, "");
  SendEach(slow, header.substr(0, 3));
  uint32_t claim = 16 << 20;
  std::memcpy(&header[4], &claim, 4);
  SendEach(huge, header);
  claim = 1 << 20;
  std::memcpy(&header[4], &claim, 4);
  SendEach(big, header + std::string(64 << 10, 'x'));

  const absl::Duration loaded = Median(peer->address(), 7);
  const uint64_t rss_during = RssKiB(peer->pid());
  std::printf("first transfer: unloaded %s, under attack %s (%.2fx); RSS %lu KiB -> %lu KiB\n",
              absl::FormatDuration(unloaded).c_str(), absl::FormatDuration(loaded).c_str(),
              absl::FDivDuration(loaded, unloaded), static_cast<unsigned long>(rss_before),
              static_cast<unsigned long>(rss_during));
  EXPECT_LE(loaded, 10 * unloaded);
  EXPECT_LT(rss_during, rss_before + (64 << 10));

  // The attackers leave; the engine serves as before.
  idle.clear();
  slow.clear();
  huge.clear();
  big.clear();
  silent_data.clear();
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_LT(LegitimateFirstTransfer(peer->address()), absl::Seconds(5));
}

}  // namespace
}  // namespace kvferry
