#include "topology/location.h"

#include "gtest/gtest.h"

namespace kvferry {
namespace topology {
namespace {

TEST(Location, ParsesEveryFormAndPrintsItBack) {
  for (const char* text : {"", "cpu:0", "cpu:3", "cuda:0", "cuda:7", "pci:0000:3b:00.0"}) {
    auto l = ParseLocation(text);
    ASSERT_TRUE(l.ok()) << text << ": " << l.status();
    EXPECT_EQ(l->ToString(), text);
  }
  EXPECT_EQ(*ParseLocation("cuda:2"), Location::Cuda(2));
  EXPECT_EQ(ParseLocation("cpu:1")->kind, Location::Kind::kCpu);
  EXPECT_FALSE(ParseLocation("PCI:1").ok()) << "kinds are lower case";
  EXPECT_EQ(ParseLocation("pci:0000:3B:00.0")->pci_address, "0000:3b:00.0");
}

TEST(Location, RefusesWhatIsNotALocation) {
  for (const char* text : {"cpu", "cpu:", "cpu:-1", "cuda:x", "gpu:0", "pci:", "cuda:1.5", ":3"}) {
    auto l = ParseLocation(text);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << text;
    if (!l.ok()) EXPECT_NE(l.status().message().find(text), absl::string_view::npos);
  }
}

TEST(Location, PciDistanceCountsHopsThroughTheLastSharedBridge) {
  const char* gpu = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0";
  EXPECT_EQ(PciDistance(gpu, gpu), 0);
  EXPECT_EQ(PciDistance(gpu, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0"), 2);
  EXPECT_EQ(PciDistance(gpu, "pci0000:00/0000:00:02.0"), 4);
  EXPECT_EQ(PciDistance(gpu, "pci0000:80/0000:80:01.0"), 6);
}

}  // namespace
}  // namespace topology
}  // namespace kvferry
