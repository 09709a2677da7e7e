// RegionTable's held uses (UseRemoteHeld): a request into the held region
// is served without a lookup, one into another region swaps what is held,
// and a held region that is being removed serves no further request: the
// next one is checked afresh (and refused), and the removal no longer
// waits for the holder.
#include "transport/tcp/region_table.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {
namespace {

tcp_wire::DataHeader WriteTo(const Region& r, uint64_t offset, uint64_t length) {
  tcp_wire::DataHeader h;
  h.type = tcp_wire::kWriteReq;
  h.remote_addr = r.addr + offset;
  h.rkey = r.keys[0];
  h.length = length;
  return h;
}

TEST(RegionTableTest, AHeldRegionServesItsOwnKeyAndSwapsForAnother) {
  std::vector<char> a(4096), b(4096);
  RegionTable t;
  const Region ra =
      t.Add(reinterpret_cast<uint64_t>(a.data()), a.size(), Access::kRemoteWrite, -1, nullptr);
  const Region rb =
      t.Add(reinterpret_cast<uint64_t>(b.data()), b.size(), Access::kRemoteWrite, -1, nullptr);
  RegionTable::Held held;
  char* target = nullptr;
  int device = 7;
  ASSERT_TRUE(t.UseRemoteHeld(WriteTo(ra, 100, 10), true, 3, &held, &target, &device).ok());
  EXPECT_EQ(target, a.data() + 100);
  EXPECT_EQ(device, -1);
  EXPECT_TRUE(held.holding());
  // Out of the held region's bounds: refused like any request.
  EXPECT_FALSE(t.UseRemoteHeld(WriteTo(ra, 4090, 10), true, 3, &held, &target, &device).ok());
  // Another key: checked afresh, and held instead.
  ASSERT_TRUE(t.UseRemoteHeld(WriteTo(rb, 0, 4096), true, 3, &held, &target, &device).ok());
  EXPECT_EQ(target, b.data());
  // No right to READ: refused from the held region too.
  tcp_wire::DataHeader read = WriteTo(rb, 0, 8);
  read.type = tcp_wire::kReadReq;
  EXPECT_FALSE(t.UseRemoteHeld(read, false, 3, &held, &target, &device).ok());
  held.Release();
  EXPECT_TRUE(t.Remove(ra.id).ok());
  EXPECT_TRUE(t.Remove(rb.id).ok());
}

TEST(RegionTableTest, AHeldRegionBeingRemovedServesNoFurtherRequest) {
  std::vector<char> a(4096);
  RegionTable t;
  const Region ra =
      t.Add(reinterpret_cast<uint64_t>(a.data()), a.size(), Access::kRemoteWrite, -1, nullptr);
  RegionTable::Held held;
  char* target = nullptr;
  int device = -1;
  ASSERT_TRUE(t.UseRemoteHeld(WriteTo(ra, 0, 64), true, 3, &held, &target, &device).ok());

  // Remove waits for the held use (up to its 1 s grace period).
  std::atomic<bool> removed{false};
  const absl::Time start = absl::Now();
  absl::Time done;
  std::thread remover([&] {
    EXPECT_TRUE(t.Remove(ra.id).ok());
    done = absl::Now();
    removed = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(removed.load()) << "Remove did not wait for the held use";
  // The next request into the region, meanwhile, is checked afresh: the
  // region is gone, so it is refused and nothing stays held.
  target = nullptr;
  const absl::Status next = t.UseRemoteHeld(WriteTo(ra, 64, 64), true, 3, &held, &target, &device);
  EXPECT_FALSE(next.ok()) << "a request into a region being removed was served";
  EXPECT_FALSE(held.holding());
  remover.join();
  EXPECT_LT(done - start, absl::Milliseconds(900)) << "Remove waited for its grace period";
}

}  // namespace
}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
