#include "net/interfaces.h"

#include <netinet/in.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace kvferry {
namespace net {
namespace {

std::vector<InterfaceAddress> Sample() {
  return {
      {"lo", "127.0.0.1", AF_INET, true, true},     {"eth0", "2001:db8::5", AF_INET6, true, false},
      {"eth0", "192.0.2.2", AF_INET, true, false},  {"ib0", "10.1.0.7", AF_INET, true, false},
      {"down0", "10.9.9.9", AF_INET, false, false},
  };
}

TEST(ChooseLocalHost, FollowsThePreferenceOrderWithReasons) {
  auto c = ChooseLocalHost("10.5.5.5", "ib0", Sample(), "eth0");
  EXPECT_EQ(c.host, "10.5.5.5");
  EXPECT_EQ(c.reason, "set explicitly");
  c = ChooseLocalHost("", "ib0", Sample(), "eth0");
  EXPECT_EQ(c.host, "10.1.0.7");
  EXPECT_NE(c.reason.find("RDMA"), std::string::npos);
  c = ChooseLocalHost("", "", Sample(), "eth0");
  EXPECT_EQ(c.host, "192.0.2.2");  // IPv4 preferred on the interface
  EXPECT_NE(c.reason.find("default route"), std::string::npos);
  c = ChooseLocalHost("", "missing0", Sample(), "");
  EXPECT_EQ(c.host, "192.0.2.2");  // first up non-loopback IPv4
  EXPECT_NE(c.reason.find("first up non-loopback"), std::string::npos);
  c = ChooseLocalHost("", "", {{"lo", "127.0.0.1", AF_INET, true, true}}, "");
  EXPECT_EQ(c.host, "127.0.0.1");
  EXPECT_NE(c.reason.find("loopback"), std::string::npos);
}

TEST(DefaultRouteInterface, ReadsProcNetRoute) {
  const std::string root = std::string(getenv("TEST_TMPDIR")) + "/proc";
  std::filesystem::create_directories(root + "/net");
  {
    std::ofstream f(root + "/net/route");
    f << "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
      << "eth1\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
      << "eth7\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
  }
  EXPECT_EQ(DefaultRouteInterface(root), "eth7");
  EXPECT_EQ(DefaultRouteInterface(root + "/nonexistent"), "");
}

TEST(IsThisHost, LoopbackOrOneOfTheListedAddresses) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.1.2.3"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.5"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("::"));
  const std::vector<InterfaceAddress> mine = {{"eth0", "10.0.0.5", AF_INET, true, false},
                                              {"eth0", "2001:db8::5", AF_INET6, true, false}};
  EXPECT_TRUE(IsThisHost("10.0.0.5", mine));
  EXPECT_TRUE(IsThisHost("2001:db8::5", mine));
  EXPECT_TRUE(IsThisHost("127.0.0.2", mine));
  EXPECT_FALSE(IsThisHost("10.0.0.6", mine));
  EXPECT_FALSE(IsThisHost("10.0.0.5", {}));
  EXPECT_FALSE(IsThisHost("peer.example", mine));
}

TEST(ListInterfaceAddresses, FindsLoopback) {
  auto list = ListInterfaceAddresses();
  ASSERT_TRUE(list.ok()) << list.status();
  bool loopback = false;
  for (const auto& a : *list) loopback |= a.loopback && a.ip == "127.0.0.1";
  EXPECT_TRUE(loopback);
}

}  // namespace
}  // namespace net
}  // namespace kvferry
