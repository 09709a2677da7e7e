#include "base/logging.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace {

class LoggingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogSink([this](LogSeverity s, absl::string_view line) {
      lines_.emplace_back(line);
      severities_.push_back(s);
    });
    SetLogThreshold(LogSeverity::kInfo);
  }
  void TearDown() override {
    SetLogSink(nullptr);
    SetLogThreshold(LogSeverity::kInfo);
  }
  std::vector<std::string> lines_;
  std::vector<LogSeverity> severities_;
};

TEST_F(LoggingTest, FormatsPrefixAndMessage) {
  KVF_LOG(WARNING) << "peer " << 42 << " slow";
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_EQ(lines_[0][0], 'W');
  EXPECT_NE(lines_[0].find("logging_test.cc:"), std::string::npos);
  EXPECT_NE(lines_[0].find("] peer 42 slow"), std::string::npos);
  EXPECT_EQ(severities_[0], LogSeverity::kWarning);
}

TEST_F(LoggingTest, BelowThresholdIsDroppedAndNotEvaluated) {
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  KVF_LOG(DEBUG) << count();
  EXPECT_TRUE(lines_.empty());
  EXPECT_EQ(evaluated, 0);
  SetLogThreshold(LogSeverity::kDebug);
  KVF_LOG(DEBUG) << count();
  EXPECT_EQ(lines_.size(), 1u);
  EXPECT_EQ(evaluated, 1);
  SetLogThreshold(LogSeverity::kError);
  KVF_LOG(WARNING) << "dropped";
  KVF_LOG(ERROR) << "kept";
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_EQ(lines_[1][0], 'E');
}

TEST(LogSeverityParse, AcceptsNamesRejectsOthers) {
  LogSeverity s;
  EXPECT_TRUE(ParseLogSeverity("WARNING", &s));
  EXPECT_EQ(s, LogSeverity::kWarning);
  EXPECT_TRUE(ParseLogSeverity("debug", &s));
  EXPECT_EQ(s, LogSeverity::kDebug);
  EXPECT_FALSE(ParseLogSeverity("loud", &s));
}

}  // namespace
}  // namespace kvferry
