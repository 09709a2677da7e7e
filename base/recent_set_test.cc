#include "base/recent_set.h"

#include <string>
#include <utility>

#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(RecentSet, ForgetsTheOldestBeyondItsCapacity) {
  RecentSet<int> s(3);
  EXPECT_TRUE(s.Insert(1));
  EXPECT_TRUE(s.Insert(2));
  EXPECT_FALSE(s.Insert(1));  // present: keeps its age
  EXPECT_TRUE(s.Insert(3));
  EXPECT_TRUE(s.Contains(1) && s.Contains(2) && s.Contains(3));
  EXPECT_TRUE(s.Insert(4));  // 1, the oldest, goes
  EXPECT_FALSE(s.Contains(1));
  EXPECT_TRUE(s.Contains(2) && s.Contains(3) && s.Contains(4));
  EXPECT_EQ(s.size(), 3u);
}

TEST(RecentSet, PairsOfStringAndNumber) {
  RecentSet<std::pair<std::string, uint64_t>> s(2);
  EXPECT_TRUE(s.Insert({"r", 1}));
  EXPECT_TRUE(s.Insert({"r", 2}));
  EXPECT_TRUE(s.Contains({"r", 1}));
  EXPECT_FALSE(s.Contains({"q", 1}));
  EXPECT_TRUE(s.Insert({"q", 1}));
  EXPECT_FALSE(s.Contains({"r", 1}));
}

TEST(RecentMap, KeepsTheValuesOfTheLastKeys) {
  RecentMap<std::string, int> m(2);
  m["a"] = 1;
  m["b"] = 2;
  m["a"] += 10;  // present: keeps its age and value
  EXPECT_EQ(*m.Find("a"), 11);
  m["c"] = 3;  // "a", the oldest, goes
  EXPECT_EQ(m.Find("a"), nullptr);
  ASSERT_NE(m.Find("b"), nullptr);
  EXPECT_EQ(*m.Find("b"), 2);
  EXPECT_EQ(*m.Find("c"), 3);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m["d"], 0);  // inserted value-initialized
}

}  // namespace
}  // namespace kvferry
