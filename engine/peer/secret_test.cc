#include "engine/peer/secret.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

class SecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("KVFERRY_SECRET");
    unsetenv("KVFERRY_SECRET_FILE");
  }
  void TearDown() override { SetUp(); }
  std::string WriteFile(const std::string& contents, mode_t mode = 0600) {
    const char* dir = std::getenv("TEST_TMPDIR");
    std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/secret";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << contents;
    ::chmod(path.c_str(), mode);
    return path;
  }
};

TEST_F(SecretTest, ConfiguredThenEnvironmentThenFile) {
  EXPECT_EQ(*ResolveSecret(""), "");
  setenv("KVFERRY_SECRET", "from-the-environment", 1);
  EXPECT_EQ(*ResolveSecret("configured-secret"), "configured-secret");
  EXPECT_EQ(*ResolveSecret(""), "from-the-environment");
  unsetenv("KVFERRY_SECRET");
  setenv("KVFERRY_SECRET_FILE", WriteFile("from-a-file-0123456789\n").c_str(), 1);
  EXPECT_EQ(*ResolveSecret(""), "from-a-file-0123456789");  // the newline dropped
}

TEST_F(SecretTest, AmbiguousEmptyOrMissingSourcesAreErrors) {
  setenv("KVFERRY_SECRET", "from-the-environment", 1);
  setenv("KVFERRY_SECRET_FILE", WriteFile("x").c_str(), 1);
  EXPECT_EQ(ResolveSecret("").status().code(), absl::StatusCode::kInvalidArgument);
  unsetenv("KVFERRY_SECRET");
  setenv("KVFERRY_SECRET_FILE", WriteFile("\n").c_str(), 1);
  EXPECT_EQ(ResolveSecret("").status().code(), absl::StatusCode::kInvalidArgument);
  setenv("KVFERRY_SECRET_FILE", "/nonexistent/kvferry-secret", 1);
  absl::StatusOr<std::string> missing = ResolveSecret("");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/kvferry-secret"), std::string::npos);
}

TEST(Secret, Warnings) {
  EXPECT_TRUE(WarnIfUnauthenticated(false, "10.0.0.5"));
  EXPECT_TRUE(WarnIfUnauthenticated(false, "0.0.0.0"));
  EXPECT_FALSE(WarnIfUnauthenticated(true, "10.0.0.5"));
  EXPECT_FALSE(WarnIfUnauthenticated(false, "127.0.0.1"));
  EXPECT_FALSE(WarnIfUnauthenticated(false, "nic1.sim"));  // the simulator
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
