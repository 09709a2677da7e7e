#include "engine/prepared/desc_list.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

TEST(DescList, APoolOfBlocksIsOneRunPerRegion) {
  // vLLM's layout: entry r * blocks + b is region r's block b.
  constexpr uint64_t kRegions = 64, kBlocks = 20000, kBlock = 32 << 10;
  DescList list;
  for (uint64_t r = 0; r < kRegions; ++r) {
    const uint64_t base = (uint64_t{1} << 40) + r * (kBlocks * kBlock + 4096);
    for (uint64_t b = 0; b < kBlocks; ++b) {
      list.Add({base + b * kBlock, kBlock, base + kBlocks * kBlock});
    }
  }
  EXPECT_EQ(list.size(), kRegions * kBlocks);
  EXPECT_EQ(list.runs(), kRegions);
  EXPECT_LT(list.bytes(), 8192u);  // not 1.28 M entries
  for (uint64_t i :
       {uint64_t{0}, uint64_t{1}, kBlocks - 1, kBlocks, 5 * kBlocks + 77, kRegions * kBlocks - 1}) {
    const uint64_t r = i / kBlocks, b = i % kBlocks;
    const uint64_t base = (uint64_t{1} << 40) + r * (kBlocks * kBlock + 4096);
    const DescList::Entry e = list.At(i);
    EXPECT_EQ(e.addr, base + b * kBlock) << i;
    EXPECT_EQ(e.length, kBlock);
    EXPECT_EQ(e.bound, base + kBlocks * kBlock);
  }
}

TEST(DescList, AnyListReadsBackEntryForEntry) {
  // Runs broken by a length, a bound, a step that changes or goes down.
  std::mt19937_64 rng(7);
  std::vector<DescList::Entry> entries;
  uint64_t addr = 4096;
  for (int i = 0; i < 5000; ++i) {
    const uint64_t kind = rng() % 10;
    const uint64_t length = kind == 0 ? 100 + rng() % 50 : 2048;
    if (kind == 1) {
      addr -= std::min<uint64_t>(addr - 1, 8192);  // down
    } else if (kind == 2) {
      addr += 3 * 4096;  // another step
    } else {
      addr += 4096;
    }
    entries.push_back({addr, length, kind == 3 ? uint64_t{1} : uint64_t{0}});
  }
  DescList list;
  for (const auto& e : entries) list.Add(e);
  ASSERT_EQ(list.size(), entries.size());
  EXPECT_LT(list.runs(), entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const DescList::Entry e = list.At(i);
    ASSERT_EQ(e.addr, entries[i].addr) << i;
    ASSERT_EQ(e.length, entries[i].length) << i;
    ASSERT_EQ(e.bound, entries[i].bound) << i;
  }
}

TEST(DescList, RepeatedAddressesAreEachTheirOwnRun) {
  DescList list;
  for (int i = 0; i < 3; ++i) list.Add({1000, 10, 2000});
  EXPECT_EQ(list.runs(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(list.At(i).addr, 1000u);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
