// Without a driver library: no GPU support, and a clear reason.
#include <cstdlib>

#include "cuda/driver.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace cuda {
namespace {

TEST(NoDriverTest, AMissingLibraryMeansNoGpuSupport) {
  setenv("KVFERRY_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
  EXPECT_EQ(Driver::Get(), nullptr);
  const absl::Status why = Driver::LoadError();
  EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(why.message().find("/nonexistent/libcuda.so.1"), std::string::npos) << why;
}

}  // namespace
}  // namespace cuda
}  // namespace kvferry
