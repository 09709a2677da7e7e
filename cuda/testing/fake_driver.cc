#include "cuda/testing/fake_driver.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvferry {
namespace cuda {

const Driver* UseFakeDriver() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    const std::string path =
        std::string(srcdir) + "/" + workspace + "/cuda/testing/libfakecuda.so";
    setenv("KVFERRY_CUDA_LIBRARY", path.c_str(), 1);
  }
  const Driver* d = Driver::Get();
  if (d == nullptr) std::fprintf(stderr, "fake driver: %s\n", Driver::LoadError().ToString().c_str());
  return d;
}

}  // namespace cuda
}  // namespace kvferry
