// Route-aware pairing. The pure parts run everywhere; ResolveRoute runs for
// real inside a Soft-RoCE VM pair (tools/softroce/vm.sh --pair sets
// KVFERRY_VM_IP and KVFERRY_VM_PEER_IP), where rdma_cm resolves over the
// virtio NIC. Elsewhere (no rdma_cm, or rxe on lo) it must fail cleanly.
#include "transport/verbs/route.h"

#include <cstdlib>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace verbs {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

TEST(Route, Ipv4OfGid) {
  EXPECT_EQ(Ipv4OfGid("0000:0000:0000:0000:0000:ffff:0a00:0a01"), "10.0.10.1");
  EXPECT_EQ(Ipv4OfGid("0000:0000:0000:0000:0000:ffff:c0a8:ff02"), "192.168.255.2");
  EXPECT_EQ(Ipv4OfGid("fe80:0000:0000:0000:5054:00ff:fe12:3456"), "");  // link-local
  EXPECT_EQ(Ipv4OfGid("0000:0000:0000:0000:0000:0000:0000:0001"), "");  // ::1
  EXPECT_EQ(Ipv4OfGid("0000:0000:0000:0000:0000:ffff:0a00"), "");       // short
  EXPECT_EQ(Ipv4OfGid("0000:0000:0000:0000:0000:ffff:zz00:0a01"), "");
  EXPECT_EQ(Ipv4OfGid(""), "");
}

TEST(Route, PortForRoute) {
  std::vector<SelectedPort> ports(3);
  ports[0].device = "mlx5_0", ports[0].port = 1;
  ports[1].device = "mlx5_1", ports[1].port = 1;
  ports[2].device = "mlx5_1", ports[2].port = 2;
  EXPECT_EQ(PortForRoute({"mlx5_1", 2, "10.0.0.1"}, ports).value(), 2u);
  EXPECT_EQ(PortForRoute({"mlx5_0", 1, "10.0.0.1"}, ports).value(), 0u);
  auto missing = PortForRoute({"mlx5_3", 1, "10.0.0.1"}, ports);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("mlx5_3:1"), std::string::npos);
}

TEST(RouteCache, FailuresExpireSoonerThanRoutes) {
  RouteCache cache;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  cache.Put("10.0.0.1", absl::UnavailableError("rdma_cm: no route"), t0);
  cache.Put("10.0.0.2", uint32_t{1}, t0);
  ASSERT_NE(cache.Find("10.0.0.1", t0), nullptr);
  EXPECT_EQ(cache.Find("10.0.0.1", t0)->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.Find("10.0.0.3", t0), nullptr);
  // The failure is asked again after kRouteFailureTtl; the route stays.
  const absl::Time later = t0 + RouteCache::kRouteFailureTtl;
  EXPECT_EQ(cache.Find("10.0.0.1", later), nullptr);
  ASSERT_NE(cache.Find("10.0.0.2", later), nullptr);
  EXPECT_EQ(**cache.Find("10.0.0.2", later), 1u);
  EXPECT_EQ(cache.Find("10.0.0.2", t0 + RouteCache::kRouteTtl), nullptr);
  // A new answer replaces the expired one.
  cache.Put("10.0.0.1", uint32_t{0}, later);
  EXPECT_EQ(**cache.Find("10.0.0.1", later), 0u);
}

TEST(Route, MalformedAddressIsInvalidArgument) {
  EXPECT_EQ(ResolveRoute("10.0.0.300").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveRoute("host.example").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Route, ResolvesThePeerOfAVmPairOrFailsCleanly) {
  const std::string ip = Env("KVFERRY_VM_IP"), peer = Env("KVFERRY_VM_PEER_IP");
  if (peer.empty()) {
    // No usable rdma_cm here (no RDMA at all, or Soft-RoCE on lo).
    auto r = ResolveRoute("127.0.0.1", absl::Seconds(2));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    return;
  }
  // The other VM may still be booting (no ARP answer yet): try for a while.
  absl::StatusOr<Route> r;
  const absl::Time give_up = absl::Now() + absl::Seconds(90);
  do {
    r = ResolveRoute(peer, absl::Seconds(5));
  } while (!r.ok() && absl::Now() < give_up);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, "rxe0");
  EXPECT_EQ(r->port, 1u);
  EXPECT_EQ(r->source_ip, ip);
  // Nobody answers ARP for this address: a bounded failure, not a hang.
  const absl::Time start = absl::Now();
  auto nobody = ResolveRoute("10.0.10.77", absl::Seconds(2));
  EXPECT_FALSE(nobody.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
}

}  // namespace
}  // namespace verbs
}  // namespace transport
}  // namespace kvferry
