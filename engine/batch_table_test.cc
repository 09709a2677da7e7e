#include "engine/batch_table.h"

#include <set>

#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

TEST(BatchTableTest, ReleasedIdsStayUnknownWhenTheirSlotIsReused) {
  BatchTable t;
  Batch* b;
  const BatchId first = t.Create(&b);
  ASSERT_NE(first, 0u);
  b->op.resize(8);
  t.Recycle(first);
  EXPECT_EQ(t.Find(first), nullptr);

  const BatchId second = t.Create(&b);  // the same slot, emptied
  EXPECT_NE(second, first);
  EXPECT_TRUE(b->op.empty());
  EXPECT_GE(b->op.capacity(), 8u);  // its vector kept for reuse
  EXPECT_EQ(t.Find(second), b);
  EXPECT_EQ(t.Find(first), nullptr);
  t.Recycle(first);  // a stale id frees nothing
  EXPECT_EQ(t.Find(second), b);
  EXPECT_EQ(t.Find(0), nullptr);
  EXPECT_EQ(t.Find(uint64_t{1} << 40 | 77), nullptr);  // never handed out
}

TEST(BatchTableTest, SlicesAreFoundUntilErasedAndIdsAreUnique) {
  BatchTable t;
  std::set<uint64_t> live;
  for (uint64_t i = 0; i < 1000; ++i) {
    Slice s;
    s.length = i;
    const uint64_t id = t.AddSlice(s);
    EXPECT_NE(id, 0u);
    EXPECT_TRUE(live.insert(id).second);
    if (i % 3 == 0) {
      t.EraseSlice(id);
      live.erase(id);
      EXPECT_EQ(t.FindSlice(id), nullptr);
    }
  }
  for (uint64_t id : live) {
    ASSERT_NE(t.FindSlice(id), nullptr);
    EXPECT_NE(t.FindSlice(id)->length % 3, 0u);  // the erased ones are gone
  }
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
