#include "engine/pipeline/batch_table.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

TEST(BatchTableTest, ReleasedIdsStayUnknownWhenTheirSlotIsReused) {
  BatchTable t;
  Batch* b;
  const BatchId first = t.Create(&b);
  ASSERT_NE(first, 0u);
  b->requests.resize(8);
  t.Recycle(first);
  EXPECT_EQ(t.Find(first), nullptr);

  const BatchId second = t.Create(&b);  // the same slot, emptied
  EXPECT_NE(second, first);
  EXPECT_TRUE(b->requests.empty());
  EXPECT_GE(b->requests.capacity(), 8u);  // its vector kept for reuse
  EXPECT_EQ(t.Find(second), b);
  EXPECT_EQ(t.Find(first), nullptr);
  t.Recycle(first);  // a stale id frees nothing
  EXPECT_EQ(t.Find(second), b);
  EXPECT_EQ(t.Find(0), nullptr);
  EXPECT_EQ(t.Find(uint64_t{1} << 40 | 77), nullptr);  // never handed out
}

// A table's ids carry its tag (the lane holding them), and a table finds
// only its own: an id of another lane's table is unknown here.
TEST(BatchTableTest, IdsCarryTheTablesTag) {
  BatchTable lane3(3), lane7(7);
  Batch* b;
  const BatchId in3 = lane3.Create(&b);
  const BatchId in7 = lane7.Create(&b);
  EXPECT_EQ(BatchTable::TagOf(in3), 3);
  EXPECT_EQ(BatchTable::TagOf(in7), 7);
  EXPECT_EQ(BatchTable::TagOf(lane7.AddSlice(Slice{})), 7);
  EXPECT_NE(lane3.Find(in3), nullptr);
  EXPECT_NE(in3, in7);
  const uint64_t untagged = in7 & ~(uint64_t{0xff} << BatchTable::kTagShift);
  EXPECT_EQ(lane3.Find(untagged | (uint64_t{3} << BatchTable::kTagShift)),
            lane3.Find(in3));  // the same slot and generation: only the tag differed
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

// A reserved slice (a lone request's work request carries its id before
// its batch exists) keeps its id until erased: from a fresh slot, a freed
// one, and past a generation's wrap, no live id is given twice and none is 0.
TEST(BatchTableTest, ReservedSlicesKeepDistinctIds) {
  BatchTable t(5);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    Slice s;
    s.length = i + 1;
    ids.push_back(t.AddSlice(s));
    ASSERT_NE(t.FindSlice(ids.back()), nullptr);
    EXPECT_EQ(t.FindSlice(ids.back())->batch, 0u);  // not committed
  }
  t.EraseSlice(ids[1]);
  t.EraseSlice(ids[3]);
  for (int i = 0; i < 3; ++i) {  // two freed slots, then a fresh one
    const uint64_t got = t.AddSlice(Slice{});
    EXPECT_NE(got, ids[1]);
    EXPECT_NE(got, ids[3]);
    EXPECT_EQ(t.FindSlice(ids[1]), nullptr);
    EXPECT_EQ(t.FindSlice(ids[3]), nullptr);
    EXPECT_EQ(t.FindSlice(ids[0])->length, 1u);
    EXPECT_EQ(BatchTable::TagOf(got), 5);
  }
  // One slot through more generations than the id holds.
  BatchTable w;
  uint64_t last = 0;
  for (uint64_t i = 0; i <= BatchTable::kGenerationMask + 1; ++i) {
    const uint64_t got = w.AddSlice(Slice{});
    ASSERT_NE(got, 0u) << "after " << i << " reuses";
    ASSERT_NE(got, last) << "after " << i << " reuses";
    ASSERT_EQ(w.FindSlice(last), nullptr);
    last = got;
    w.EraseSlice(last);
  }
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
