// The transport conformance suite over libibverbs. On a host without an
// active RDMA port every case is skipped with the reason; inside the
// Soft-RoCE VM (tools/softroce/vm.sh) they run for real, and
// KVFERRY_REQUIRE_RDMA=1 turns a missing device into a failure.
#include <cstdlib>
#include <cstring>
#include <memory>

#include "base/clock.h"
#include "transport/testing/conformance.h"
#include "transport/verbs/test_ports.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace {

using testing::TransportConformanceTest;

class VerbsHarness : public testing::TransportHarness {
 public:
  absl::StatusOr<std::unique_ptr<Transport>> NewTransport() override {
    VerbsTransportOptions o;
    o.ports = {ports_.ports()[0]};
    o.request_timeout = absl::Seconds(3);
    return CreateVerbsTransport(o);
  }
  Clock* clock() override { return RealClock(); }
  absl::Duration PeerLossBound() override { return absl::Seconds(5); }
  std::string SkipReason() override { return ports_.SkipReason(); }

 private:
  verbs::TestPorts ports_;
};

// Verbs-only cases, on the same harness.
class VerbsTest : public TransportConformanceTest {};

// Each link reserves its send queue's depth in the NIC's CQ (an error
// flushes even unsignaled work requests): twelve links of 1,024 need more
// than the 8,192 entries a CQ starts with, so it grows; a chain of 64
// WRITEs with one signaled completion then completes every request.
TEST_P(VerbsTest, ManyLinksGrowTheCqAndAChainCompletesEveryRequest) {
  Pair p = MakePair();
  std::pair<LinkId, LinkId> last{p.link_a, p.link_b};
  for (int i = 0; i < 11; ++i) {
    auto l = Connect(*p.a, *p.b);
    ASSERT_TRUE(l.ok()) << "link " << i + 2 << ": " << l.status();
    last = *l;
  }
  constexpr size_t kCount = 64, kBlock = 1024;
  Buffer src = MakeBuffer(*p.a, kCount * kBlock, 41);
  Buffer dst = MakeBuffer(*p.b, kCount * kBlock, 42);
  std::vector<WorkRequest> batch;
  for (size_t i = 0; i < kCount; ++i) {
    batch.push_back(Write(last.first, src, i * kBlock, dst, i * kBlock, kBlock, 0, i));
  }
  ASSERT_TRUE(p.a->Post(batch).ok());
  std::vector<Completion> c = WaitFor(*p.a, kCount);
  ASSERT_EQ(c.size(), kCount);
  std::vector<bool> seen(kCount, false);
  for (const Completion& done : c) {
    ASSERT_LT(done.cookie, kCount);
    EXPECT_FALSE(seen[done.cookie]) << "request " << done.cookie << " completed twice";
    seen[done.cookie] = true;
    EXPECT_TRUE(done.status.ok()) << done.status;
  }
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), kCount * kBlock), 0);
}

INSTANTIATE_TEST_SUITE_P(Verbs, VerbsTest,
                         ::testing::Values(testing::ConformanceParam{
                             "verbs", [] { return std::make_unique<VerbsHarness>(); }}),
                         testing::ConformanceParamName);

INSTANTIATE_TEST_SUITE_P(Verbs, TransportConformanceTest,
                         ::testing::Values(testing::ConformanceParam{
                             "verbs", [] { return std::make_unique<VerbsHarness>(); }}),
                         testing::ConformanceParamName);

}  // namespace
}  // namespace transport
}  // namespace kvferry
