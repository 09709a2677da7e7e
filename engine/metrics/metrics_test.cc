// Metrics through the C++ API and the Prometheus endpoint, scraped over a
// real socket while traffic flows.
#include "engine/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "net/socket.h"

namespace kvferry {
namespace {

using transport::Opcode;

// GETs `path` from host:port; the whole HTTP response.
std::string Get(const std::string& address, const std::string& path) {
  auto hp = net::ParseHostPort(address);
  if (!hp.ok()) return "";
  auto fd = net::Connect(*hp, absl::Seconds(5));
  if (!fd.ok()) return "";
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
  if (!net::WriteFull(fd->get(), req.data(), req.size(), absl::Now() + absl::Seconds(5)).ok()) {
    return "";
  }
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd->get(), buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, n);
  }
  return out;
}

// The value of the sample whose line starts with `series` (name{labels}).
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = -1;
      (void)absl::SimpleAtod(line.substr(series.size() + 1), &v);
      return v;
    }
  }
  return -1;
}

TEST(Metrics, HistogramBucketsAndQuantiles) {
  LatencyHistogram h;
  EXPECT_EQ(h.QuantileBound(0.5), 0);
  for (int i = 0; i < 90; ++i) h.Record(absl::Microseconds(20));
  for (int i = 0; i < 10; ++i) h.Record(absl::Milliseconds(3));
  EXPECT_EQ(h.count(), 100u);
  EXPECT_DOUBLE_EQ(h.QuantileBound(0.5), 2.5e-5);
  EXPECT_DOUBLE_EQ(h.QuantileBound(0.99), 5e-3);
  const std::vector<uint64_t> c = h.Cumulative();
  EXPECT_EQ(c.back(), 100u);
  EXPECT_NEAR(h.sum_seconds(), 90 * 20e-6 + 10 * 3e-3, 1e-9);
}

// LatencyMemo records what Record would, whether the pair repeats or only
// its submission time or only its `now` changes.
TEST(Metrics, LatencyMemoRecordsAsRecordDoes) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  struct Pair {
    absl::Time submitted, now;
  };
  const std::vector<Pair> pairs = {
      {t0, t0 + absl::Microseconds(20)},                         // bucket 1
      {t0, t0 + absl::Microseconds(20)},                         // the same again
      {t0, t0 + absl::Milliseconds(7)},                          // the same batch, a later poll
      {t0 - absl::Milliseconds(2), t0 + absl::Milliseconds(7)},  // another batch, the same poll
      {t0 + absl::Seconds(1), t0},                               // a clock that stepped back
  };
  LatencyHistogram direct, memo;
  LatencyMemo m;
  for (const Pair& p : pairs) {
    direct.Record(p.now - p.submitted);
    m.Record(memo, p.submitted, p.now);
  }
  EXPECT_EQ(memo.count(), pairs.size());
  EXPECT_EQ(memo.Cumulative(), direct.Cumulative());
  EXPECT_DOUBLE_EQ(memo.sum_seconds(), direct.sum_seconds());
}

// A bucket holds what is at most its bound (Prometheus' "le"): a request of
// exactly 10 us is in the first, one nanosecond more in the second, and
// one beyond the last bound (or an infinite duration) only in +Inf.
TEST(Metrics, HistogramBoundsAreInclusive) {
  const std::vector<double>& bounds = LatencyHistogram::Bounds();
  ASSERT_EQ(bounds.size(), 19u);
  EXPECT_EQ(bounds.front(), 1e-5);
  EXPECT_EQ(bounds[7], 2.5e-3);
  EXPECT_EQ(bounds.back(), 10);
  struct Case {
    absl::Duration d;
    size_t bucket;
  };
  for (const Case& c :
       {Case{absl::ZeroDuration(), 0}, Case{absl::Microseconds(10), 0},
        Case{absl::Microseconds(10) + absl::Nanoseconds(1), 1}, Case{absl::Microseconds(25), 1},
        Case{absl::Milliseconds(1), 6}, Case{absl::Milliseconds(3), 8}, Case{absl::Seconds(10), 18},
        Case{absl::Seconds(10) + absl::Nanoseconds(1), 19}, Case{absl::InfiniteDuration(), 19},
        Case{-absl::Seconds(1), 0}}) {
    SCOPED_TRACE(absl::FormatDuration(c.d));
    LatencyHistogram h;
    h.Record(c.d);
    const std::vector<uint64_t> cumulative = h.Cumulative();
    ASSERT_EQ(cumulative.size(), 20u);
    for (size_t i = 0; i < cumulative.size(); ++i) {
      EXPECT_EQ(cumulative[i], i >= c.bucket ? 1u : 0u) << "bucket " << i;
    }
  }
}

TEST(Metrics, EndpointServesCountersThatMoveWithTraffic) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  o.metrics_port = 0;
  auto a = TransferEngine::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  o.metrics_port = -1;
  auto b = TransferEngine::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_FALSE((*a)->metrics_address().empty());
  EXPECT_TRUE((*b)->metrics_address().empty());

  const size_t kBlock = 64 << 10, kCount = 16;
  std::vector<char> src(kBlock * kCount, 'x'), dst(kBlock * kCount, 0);
  ASSERT_TRUE((*a)->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE((*b)->RegisterMemory(dst.data(), dst.size()).ok());
  auto seg = (*a)->OpenSegment((*b)->address());
  ASSERT_TRUE(seg.ok());
  const std::string peer =
      absl::StrCat("{engine=\"", (*a)->address(), "\",peer=\"", (*b)->address(), "\"");
  std::string before = Get((*a)->metrics_address(), "/metrics");
  ASSERT_TRUE(absl::StartsWith(before, "HTTP/1.1 200 OK")) << before;
  EXPECT_NE(before.find("# TYPE kvferry_requests_total counter"), std::string::npos);
  EXPECT_EQ(Sample(before, "kvferry_requests_total" + peer + "}"), 0);

  std::vector<TransferRequest> reqs;
  for (size_t i = 0; i < kCount; ++i) {
    reqs.push_back({Opcode::kWrite, src.data() + i * kBlock,
                    reinterpret_cast<uintptr_t>(dst.data()) + i * kBlock, kBlock});
  }
  for (int round = 1; round <= 2; ++round) {
    auto batch = (*a)->Submit(*seg, reqs);
    ASSERT_TRUE(batch.ok());
    ASSERT_TRUE((*a)->Wait(*batch, absl::Seconds(10))->ok());
    const std::string text = Get((*a)->metrics_address(), "/metrics");
    EXPECT_EQ(Sample(text, "kvferry_requests_total" + peer + "}"), round * kCount);
    EXPECT_EQ(Sample(text, "kvferry_peer_transport" + peer + ",transport=\"tcp\"}"), 1);
    EXPECT_EQ(Sample(text, "kvferry_peer_links" + peer + "}"),
              (*a)->GetMetrics().peers.at(0).links);
    EXPECT_GE(Sample(text, "kvferry_peer_links" + peer + "}"), 1);
    EXPECT_EQ(Sample(text, "kvferry_requests_ok_total" + peer + "}"), round * kCount);
    EXPECT_EQ(Sample(text, "kvferry_bytes_total" + peer + ",op=\"write\"}"),
              round * kCount * kBlock);
    EXPECT_EQ(Sample(text, "kvferry_request_latency_seconds_count" + peer + "}"), round * kCount);
    EXPECT_EQ(Sample(text, "kvferry_request_latency_seconds_bucket" + peer + ",le=\"+Inf\"}"),
              round * kCount);
    // The 16 adjacent blocks (1 MiB) travel as one slice over TCP.
    EXPECT_EQ(Sample(text, absl::StrCat("kvferry_nic_slices_total{engine=\"", (*a)->address(),
                                        "\",nic=\"tcp\"}")),
              round);
  }
  // A failing request shows up by its code.
  TransferRequest outside{Opcode::kWrite, src.data(), 8, 64};  // not the peer's memory
  EXPECT_FALSE((*a)->Submit(*seg, {&outside, 1}).ok());        // refused before posting
  // The peer goes, and its handshake port stays taken (bound, not
  // listening: connects are refused), so that no engine of another test
  // running at the same time takes it over and answers as a restarted peer.
  const std::string b_address = (*b)->address();
  int b_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(b_address.substr(b_address.rfind(':') + 1), &b_port));
  b->reset();
  const int hold = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(static_cast<uint16_t>(b_port));
  const bool held = ::bind(hold, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  auto doomed = (*a)->Submit(*seg, reqs);
  if (doomed.ok()) (void)(*a)->Wait(*doomed, absl::Seconds(20));
  // Every submitted request is accounted for, also those whose posting
  // failed (a Submit refused by validation submits nothing).
  const EngineMetrics m = (*a)->GetMetrics();
  ASSERT_EQ(m.peers.size(), 1u);
  EXPECT_EQ(m.peers[0].requests, 3 * kCount);
  uint64_t errors = 0;
  for (const auto& [code, n] : m.peers[0].errors) errors += n;
  EXPECT_EQ(m.peers[0].requests_ok + errors, 3 * kCount);
  if (held) EXPECT_GT(m.peers[0].errors.count("UNAVAILABLE"), 0u);
  // NIC errors (failed completions; here the posts themselves failed)
  // add up by code.
  ASSERT_EQ(m.nics.size(), 1u);
  uint64_t by_code = 0;
  for (const auto& [code, n] : m.nics[0].errors_by_code) by_code += n;
  EXPECT_EQ(by_code, m.nics[0].errors);
  const std::string text = Get((*a)->metrics_address(), "/metrics");
  if (held) {
    EXPECT_GT(Sample(text, "kvferry_request_errors_total" + peer + ",code=\"UNAVAILABLE\"}"), 0);
  }
  ::close(hold);
  EXPECT_TRUE(absl::StartsWith(Get((*a)->metrics_address(), "/other"), "HTTP/1.1 404"));
}

// The endpoint binds loopback unless told otherwise, and serves scrapers
// concurrently: silent or half-sent connections do not hold up a scrape,
// and are closed after their 2 s.
TEST(Metrics, EndpointIsLoopbackByDefaultAndServesClientsConcurrently) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  o.metrics_port = 0;
  auto a = TransferEngine::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(absl::StartsWith((*a)->metrics_address(), "127.0.0.1:"));
  auto hp = net::ParseHostPort((*a)->metrics_address());
  ASSERT_TRUE(hp.ok());
  std::vector<net::Fd> stalled;
  for (int i = 0; i < 20; ++i) {
    auto fd = net::Connect(*hp, absl::Seconds(5));
    ASSERT_TRUE(fd.ok());
    if (i % 2 == 0) ASSERT_EQ(::send(fd->get(), "GET /met", 8, MSG_NOSIGNAL), 8);
    stalled.push_back(std::move(*fd));
  }
  const absl::Time start = absl::Now();
  const std::string text = Get((*a)->metrics_address(), "/metrics");
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_TRUE(absl::StartsWith(text, "HTTP/1.1 200 OK")) << text.substr(0, 64);
  // Refused network input is counted: a bad frame at the handshake port.
  {
    auto hs = net::ParseHostPort((*a)->address());
    ASSERT_TRUE(hs.ok());
    auto fd = net::Connect(*hs, absl::Seconds(5));
    ASSERT_TRUE(fd.ok());
    ASSERT_EQ(::send(fd->get(), "GARBAGE!", 8, MSG_NOSIGNAL), 8);
    char c;
    timeval tv{5, 0};
    ::setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (::recv(fd->get(), &c, 1, 0) > 0) {
    }
  }
  const std::string after = Get((*a)->metrics_address(), "/metrics");
  EXPECT_EQ(Sample(after, absl::StrCat("kvferry_refused_input_total{engine=\"", (*a)->address(),
                                       "\",reason=\"handshake_frame_refused\"}")),
            1);
  // The stalled ones are closed by the server within its request time.
  char c;
  for (auto& fd : stalled) {
    timeval tv{5, 0};
    ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    EXPECT_EQ(::recv(fd.get(), &c, 1, 0), 0);
  }
}

}  // namespace
}  // namespace kvferry
