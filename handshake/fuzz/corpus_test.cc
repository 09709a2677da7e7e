// Replays every seed of the fuzz corpus and every input that once crashed
// a fuzzer (regressions/<fuzzer>/) through the fuzz targets, in the normal
// build (and so under ASan/UBSan/TSan in CI). One test case per file.
#include <dirent.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "handshake/fuzz/data_fuzz_targets.h"
#include "handshake/fuzz/fuzz_targets.h"

namespace kvferry {
namespace handshake {
namespace {

struct Input {
  std::string fuzzer;  // "frame" or "descriptor"
  std::string path;
  std::string name;
};

std::vector<Input> ListInputs() {
  std::vector<Input> out;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return out;
  const std::string root = std::string(srcdir) + "/" + workspace + "/handshake/fuzz/";
  for (const char* kind : {"corpus", "regressions"}) {
    for (const char* fuzzer :
         {"frame", "descriptor", "auth", "hello", "data", "vmm_reply", "vmm_request"}) {
      const std::string dir = root + kind + "/" + fuzzer;
      DIR* d = opendir(dir.c_str());
      if (d == nullptr) continue;
      while (dirent* e = readdir(d)) {
        const std::string file = e->d_name;
        if (file == "." || file == ".." || file == "README") continue;
        std::string name = std::string(kind) + "_" + fuzzer + "_" + file;
        for (char& c : name) {
          if (!isalnum(static_cast<unsigned char>(c))) c = '_';
        }
        out.push_back({fuzzer, dir + "/" + file, name});
      }
      closedir(d);
    }
  }
  return out;
}

class CorpusTest : public ::testing::TestWithParam<Input> {};

TEST_P(CorpusTest, DecodesWithoutCrashing) {
  std::ifstream f(GetParam().path, std::ios::binary);
  ASSERT_TRUE(f) << GetParam().path;
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  if (GetParam().fuzzer == "frame") {
    FuzzFrame(data, bytes.size());
  } else if (GetParam().fuzzer == "auth") {
    FuzzAuthenticated(data, bytes.size());
  } else if (GetParam().fuzzer == "hello") {
    FuzzHello(data, bytes.size());
  } else if (GetParam().fuzzer == "data") {
    FuzzDataStream(data, bytes.size());
  } else if (GetParam().fuzzer == "vmm_reply") {
    FuzzVmmReply(data, bytes.size());
  } else if (GetParam().fuzzer == "vmm_request") {
    FuzzVmmRequest(data, bytes.size());
  } else {
    FuzzDescriptor(data, bytes.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Inputs, CorpusTest, ::testing::ValuesIn(ListInputs()),
                         [](const ::testing::TestParamInfo<Input>& info) {
                           return info.param.name;
                         });

// The corpus must be there: an empty list would pass vacuously.
TEST(Corpus, IsPresent) {
  size_t frames = 0, descriptors = 0, auth = 0, hello = 0, data = 0, vmm = 0, vmm_request = 0;
  for (const Input& i : ListInputs()) {
    ++(i.fuzzer == "frame"         ? frames
       : i.fuzzer == "auth"        ? auth
       : i.fuzzer == "hello"       ? hello
       : i.fuzzer == "data"        ? data
       : i.fuzzer == "vmm_reply"   ? vmm
       : i.fuzzer == "vmm_request" ? vmm_request
                                   : descriptors);
  }
  EXPECT_GE(hello, 3u);
  EXPECT_GE(data, 8u);
  EXPECT_GE(vmm, 5u);
  EXPECT_GE(vmm_request, 4u);
  EXPECT_GE(frames, 10u);
  EXPECT_GE(descriptors, 4u);
  EXPECT_GE(auth, 4u);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
