// An engine on a host without rdma-core: libibverbs.so.1 cannot be loaded
// (KVFERRY_IBVERBS_LIBRARY names a file that does not exist, set before the
// first engine loads the library). Detection says TCP and why, transfers
// run over TCP, and an engine that insists on RDMA fails naming the library.
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

constexpr char kMissing[] = "libkvferry-test-no-such-ibverbs.so.1";

class NoRdmaCore : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ::setenv("KVFERRY_IBVERBS_LIBRARY", kMissing, 1); }
};

TEST_F(NoRdmaCore, AutoChoosesTcpAndSaysWhy) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  auto e = TransferEngine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->detection().transport, "tcp");
  EXPECT_NE((*e)->detection().transport_reason.find(
                std::string(kMissing) + " not found: RDMA unavailable"),
            std::string::npos)
      << (*e)->detection().transport_reason;

  // It moves bytes over TCP.
  auto peer = TransferEngine::Create(o);
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::vector<char> src(8192, 'k'), dst(8192, 0);
  ASSERT_TRUE((*e)->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE((*peer)
                  ->RegisterMemory(dst.data(), dst.size(), transport::Access::kRemoteWrite)
                  .ok());
  auto seg = (*e)->OpenSegment((*peer)->address());
  ASSERT_TRUE(seg.ok()) << seg.status();
  TransferRequest r{transport::Opcode::kWrite, src.data(),
                    reinterpret_cast<uint64_t>(dst.data()), src.size()};
  auto batch = (*e)->Submit(*seg, {&r, 1});
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto done = (*e)->Wait(*batch, absl::Seconds(10));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->ok()) << done->requests[0];
  EXPECT_EQ(dst, src);
}

TEST_F(NoRdmaCore, AskingForRdmaNamesTheMissingLibrary) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "rdma";
  auto e = TransferEngine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find(kMissing), std::string::npos) << e.status();
  EXPECT_NE(e.status().message().find("rdma-core"), std::string::npos) << e.status();
}

TEST_F(NoRdmaCore, NamingADeviceNamesItAndTheMissingLibrary) {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.devices = {"mlx5_3"};
  auto e = TransferEngine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("RDMA device(s) mlx5_3 asked for"), std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find(kMissing), std::string::npos) << e.status();
  o.transport = "rdma";
  e = TransferEngine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("transport=rdma and RDMA device(s) mlx5_3 asked for"),
            std::string::npos)
      << e.status();
}

}  // namespace
}  // namespace kvferry
