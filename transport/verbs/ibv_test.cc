// The seam binds every entry point it names in the installed rdma-core
// (./bazelw installs libibverbs-dev and librdmacm-dev): a name that is an
// inline function in the headers, or a wrong symbol version, fails here
// instead of in a VM pair.
#include "transport/verbs/ibv.h"

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace ibv {
namespace {

TEST(Ibv, EveryEntryPointOfLibibverbsAndLibrdmacmBinds) {
  EXPECT_TRUE(Load().ok()) << Load();
  EXPECT_TRUE(LoadRdmacm().ok()) << LoadRdmacm();
  EXPECT_EQ(LibraryName(), "libibverbs.so.1");
  EXPECT_EQ(RdmacmLibraryName(), "librdmacm.so.1");
  EXPECT_NE(Cm().create_event_channel, nullptr);
  EXPECT_STREQ(WcStatusStr(IBV_WC_SUCCESS), "success");
}

}  // namespace
}  // namespace ibv
}  // namespace transport
}  // namespace kvferry
