#include "base/scratch.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(Scratch, ReusesTheCapacityOfTheLastVectorGivenBack) {
  const int* first_data = nullptr;
  {
    Scratch<int> s;
    for (int i = 0; i < 100; ++i) s->push_back(i);
    first_data = s->data();
  }
  Scratch<int> again;
  EXPECT_TRUE(again->empty());
  EXPECT_GE(again->capacity(), 100u);
  EXPECT_EQ(again->data(), first_data);
}

TEST(Scratch, NestedScratchesAreDistinctVectors) {
  Scratch<uint64_t> outer;
  outer->push_back(1);
  {
    Scratch<uint64_t> inner;
    inner->push_back(2);
    EXPECT_NE(&*outer, &*inner);
    EXPECT_EQ(inner->size(), 1u);
  }
  ASSERT_EQ(outer->size(), 1u);
  EXPECT_EQ((*outer)[0], 1u);
}

TEST(SmallScratch, SmallOnTheStackLargerFromThePool) {
  const int* pooled = nullptr;
  {
    Scratch<int> s;
    s->resize(64);
    pooled = s->data();
  }
  SmallScratch<int, 4> small(3);
  EXPECT_EQ(small.span().size(), 3u);
  EXPECT_NE(small.span().data(), pooled);  // the stack
  SmallScratch<int, 4> large(10);
  ASSERT_EQ(large.span().size(), 10u);
  EXPECT_EQ(large.span().data(), pooled);  // the pool's vector, resized
  for (int v : large.span()) EXPECT_EQ(v, 0);
  large.span()[9] = 7;
  EXPECT_EQ(large.span()[9], 7);
}

}  // namespace
}  // namespace kvferry
