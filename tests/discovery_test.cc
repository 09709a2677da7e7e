// RDMA discovery against fixture sysfs trees (tests/fixtures/sysfs).
#include "transport/verbs/discovery.h"

#include <cctype>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "tests/sysfs_fixture.h"

namespace kvferry {
namespace transport {
namespace verbs {
namespace {

DiscoveryOptions Fixture(const std::string& name) {
  const std::string manifest = absl::StrCat(std::getenv("TEST_SRCDIR"), "/",
                                            std::getenv("TEST_WORKSPACE"),
                                            "/tests/fixtures/sysfs/", name, ".tree");
  auto root = MaterializeSysfs(manifest, name);
  EXPECT_TRUE(root.ok()) << root.status();
  DiscoveryOptions o;
  o.sysfs_root = *root + "/sys";
  o.dev_root = *root + "/dev";
  return o;
}

TEST(Discovery, EightGpuServerSelectsEveryNicWithItsRoutableV2Gid) {
  auto d = Discover(Fixture("eight_gpu_server"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->devices.size(), 8u);
  EXPECT_EQ(d->gpus.size(), 8u);
  ASSERT_EQ(d->selected.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    const SelectedPort& p = d->selected[i];
    EXPECT_EQ(p.device, "mlx5_" + std::to_string(i));
    EXPECT_EQ(p.port, 1u);
    EXPECT_EQ(p.gid_index, 3u) << p.why;  // RoCE v2 with IPv4, not the v1 or link-local ones
    EXPECT_EQ(p.ipv4, "10.0." + std::to_string(i) + ".1");
    EXPECT_EQ(p.netdev, "eth" + std::to_string(i));
    EXPECT_EQ(p.numa_node, i < 4 ? 0 : 1);
  }
  // GPU 3 sits on the second switch of NUMA node 0 with mlx5_2 and mlx5_3.
  auto near = NearestPorts(*d, "cuda:3");
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_EQ(near->size(), 8u);  // every NIC stays usable, nearest first
  EXPECT_EQ((*near)[0].device, "mlx5_2");
  EXPECT_EQ((*near)[1].device, "mlx5_3");
  EXPECT_LT(PciDistance(d->gpus[3].pci_path, (*near)[0].pci_path),
            PciDistance(d->gpus[3].pci_path, (*near)[2].pci_path));
  // The farthest are on the other root complex.
  EXPECT_GE((*near)[7].numa_node, 1);
  auto cpu1 = NearestPorts(*d, "cpu:1");
  ASSERT_TRUE(cpu1.ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ((*cpu1)[i].numa_node, 1);
  EXPECT_EQ(NearestPorts(*d, "cuda:9").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(NearestPorts(*d, "tpu:0").status().code(), absl::StatusCode::kInvalidArgument);
  // By PCI address, as the CUDA driver names a device (upper case there):
  // the same GPU, whatever CUDA_VISIBLE_DEVICES makes its ordinal.
  std::string upper = d->gpus[3].pci_address;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto by_pci = NearestPorts(*d, "pci:" + upper);
  ASSERT_TRUE(by_pci.ok()) << by_pci.status();
  EXPECT_EQ((*by_pci)[0].device, "mlx5_2");
  EXPECT_EQ((*by_pci)[1].device, "mlx5_3");
  EXPECT_EQ(NearestPorts(*d, "pci:0000:ff:1f.7").status().code(), absl::StatusCode::kNotFound);
}

TEST(Discovery, CloudVmUsesItsOnlyGidIndexZero) {
  auto d = Discover(Fixture("cloud_vm"));
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->selected.size(), 1u);
  EXPECT_EQ(d->selected[0].device, "erdma_0");
  EXPECT_EQ(d->selected[0].gid_index, 0u);
  EXPECT_EQ(d->selected[0].ipv4, "172.16.0.9");
  EXPECT_TRUE(d->gpus.empty());
}

TEST(Discovery, DownPortsAndUnknownLinkLayersAreSkippedWithReasons) {
  DiscoveryOptions o = Fixture("nic_down_and_unknown");
  auto d = Discover(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->selected.size(), 1u);
  EXPECT_EQ(d->selected[0].device, "mlx5_0");
  EXPECT_EQ(d->selected[0].gid_index, 3u);
  std::string notes;
  for (const auto& n : d->notes) notes += n + "\n";
  EXPECT_NE(notes.find("mlx5_1:1 skipped: port state DOWN"), std::string::npos) << notes;
  EXPECT_NE(notes.find("qedr0:1 skipped: link layer 'Unknown'"), std::string::npos) << notes;
  // Naming a device that is down, or one that does not exist, is an error
  // that lists what is there.
  o.devices = {"mlx5_1"};
  auto down = Discover(o);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(down.status().message().find("mlx5_0 (port 1:ACTIVE)"), std::string::npos)
      << down.status();
  o.devices = {"mlx5_9"};
  auto missing = Discover(o);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("mlx5_1 (port 1:DOWN)"), std::string::npos);
  o.devices = {"mlx5_0:x"};
  EXPECT_EQ(Discover(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Discovery, AllowAndExcludeLists) {
  DiscoveryOptions o = Fixture("eight_gpu_server");
  o.devices = {"mlx5_1", "mlx5_6:1"};
  auto d = Discover(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->selected.size(), 2u);
  EXPECT_EQ(d->selected[0].device, "mlx5_1");
  EXPECT_EQ(d->selected[1].device, "mlx5_6");
  o.devices = {"^mlx5_0", "!mlx5_7"};
  d = Discover(o);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->selected.size(), 6u);
  for (const auto& p : d->selected) {
    EXPECT_NE(p.device, "mlx5_0");
    EXPECT_NE(p.device, "mlx5_7");
  }
}

TEST(Discovery, GidRankingAndOverrides) {
  DiscoveryOptions o = Fixture("mixed_gids");
  auto d = Discover(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->selected.size(), 2u);
  EXPECT_EQ(d->selected[0].device, "mlx5_0");
  EXPECT_EQ(d->selected[0].gid_index, 3u);  // never link-local or v1 when v2 routable exists
  EXPECT_NE(d->selected[0].why.find("routable IPv4 10.1.2.3"), std::string::npos);
  EXPECT_EQ(d->selected[1].device, "rxe0");
  EXPECT_EQ(d->selected[1].gid_index, 1u);  // ::ffff:127.0.0.1 beats link-local on lo
  // An explicit index, and the environment variables users already set.
  o.gid_index = 1;
  o.gid_index_source = "--gid_index";
  d = Discover(o);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->selected[0].gid_index, 1u);
  EXPECT_NE(d->selected[0].why.find("--gid_index"), std::string::npos);
  DiscoveryOptions env = Fixture("mixed_gids");
  setenv("NCCL_IB_GID_INDEX", "0", 1);
  setenv("MC_GID_INDEX", "2", 1);
  ApplyEnvironment(&env);
  EXPECT_EQ(env.gid_index, 2);
  EXPECT_EQ(env.gid_index_source, "MC_GID_INDEX");
  unsetenv("MC_GID_INDEX");
  DiscoveryOptions nccl = Fixture("mixed_gids");
  ApplyEnvironment(&nccl);
  EXPECT_EQ(nccl.gid_index, 0);
  unsetenv("NCCL_IB_GID_INDEX");
  // Index 3 does not exist on rxe0: a clear error.
  o.gid_index = 3;
  auto bad = Discover(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("rxe0:1"), std::string::npos);
}

TEST(Discovery, GidOnAnotherNetdevLosesToThePortsOwn) {
  auto d = Discover(Fixture("foreign_netdev_gid"));
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->selected.size(), 1u);
  EXPECT_EQ(d->selected[0].gid_index, 3u) << d->selected[0].why;  // not docker0's index 2
  EXPECT_EQ(d->selected[0].netdev, "eth0");
  EXPECT_EQ(d->selected[0].ipv4, "10.2.0.5");
  const GidInfo& bridge = d->devices[0].ports[0].gids[2];
  EXPECT_TRUE(bridge.foreign);
  EXPECT_NE(bridge.why.find("not the port's own eth0"), std::string::npos) << bridge.why;
}

TEST(Discovery, HostWithoutRdmaFindsNothingAndIsFine) {
  DiscoveryOptions o;
  o.sysfs_root = std::string(std::getenv("TEST_TMPDIR")) + "/empty-sys";
  auto d = Discover(o);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->devices.empty());
  EXPECT_TRUE(d->selected.empty());
}

TEST(RankGid, Order) {
  auto rank = [](const char* layer, const char* gid, const char* type) {
    GidInfo g;
    g.gid = gid;
    g.type = type;
    return RankGid(layer, &g);
  };
  const char* v4 = "0000:0000:0000:0000:0000:ffff:0a00:0001";
  EXPECT_EQ(rank("Ethernet", v4, "RoCE v2"), 0);
  EXPECT_EQ(rank("Ethernet", "2001:0db8:0000:0000:0000:0000:0000:0001", "RoCE v2"), 1);
  EXPECT_EQ(rank("InfiniBand", "fe80:0000:0000:0000:0002:c903:0000:0001", ""), 2);
  EXPECT_EQ(rank("Ethernet", "0000:0000:0000:0000:0000:ffff:7f00:0001", "RoCE v2"), 3);
  EXPECT_EQ(rank("Ethernet", "fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"), 4);
  EXPECT_EQ(rank("Ethernet", v4, "IB/RoCE v1"), 5);
}

}  // namespace
}  // namespace verbs
}  // namespace transport
}  // namespace kvferry
