#include "cuda/testing/fake_driver.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kvferry {
namespace cuda {

const Driver* UseFakeDriver() {
  // Under `bazel test`, the runfiles tree; run by hand, the runfiles beside
  // the binary, or the library next to it (tools/softroce/vm.sh --file puts
  // it there).
  std::vector<std::string> candidates;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    candidates.push_back(std::string(srcdir) + "/" + workspace + "/cuda/testing/libfakecuda.so");
  }
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    const std::string exe(self, n);
    candidates.push_back(exe + ".runfiles/kvferry/cuda/testing/libfakecuda.so");
    candidates.push_back(exe.substr(0, exe.rfind('/') + 1) + "libfakecuda.so");
  }
  for (const std::string& path : candidates) {
    if (::access(path.c_str(), R_OK) == 0) {
      setenv("KVFERRY_CUDA_LIBRARY", path.c_str(), 1);
      break;
    }
  }
  const Driver* d = Driver::Get();
  if (d == nullptr) std::fprintf(stderr, "fake driver: %s\n", Driver::LoadError().ToString().c_str());
  return d;
}

}  // namespace cuda
}  // namespace kvferry
