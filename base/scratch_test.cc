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

}  // namespace
}  // namespace kvferry
