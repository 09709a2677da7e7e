#include "engine/pipeline/link_set.h"

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

std::vector<Link> Links(int n) {
  std::vector<Link> links(n);
  for (int i = 0; i < n; ++i) {
    links[i].id = i + 1;
    links[i].local_nic = i;
  }
  return links;
}

// Threads that start at different links (their lanes' homes) each take
// their own while it is idle; ties go to the start.
TEST(ChooseLink, EachStartKeepsToItsOwnIdleLink) {
  std::vector<Link> links = Links(2);
  const absl::Time now = absl::Now();
  const Link* a = ChooseLink(links, 0, 8, /*start=*/0, now);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->id, 1u);
  a->load->Give(now);
  const Link* b = ChooseLink(links, 0, 8, /*start=*/1, now);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->id, 2u);
  EXPECT_EQ(b->inflight(), 1u);
  b->load->Give(now);
  EXPECT_EQ(b->inflight(), 0u);
  b->load->Give(now);  // nothing to give back: stays at 0
  EXPECT_EQ(b->inflight(), 0u);
}

// The least loaded link wins over the start, relative to speed; full and
// failed links are skipped; null when none has room.
TEST(ChooseLink, LeastLoadedThenNoneWhenFull) {
  std::vector<Link> links = Links(3);
  const absl::Time now = absl::Now();
  links[0].load->inflight = 3;
  links[1].load->inflight = 1;
  links[2].failed = true;
  const Link* l = ChooseLink(links, 0, 4, /*start=*/0, now);
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->id, 2u);
  EXPECT_EQ(links[1].inflight(), 2u);
  links[1].weight = 1;
  links[0].weight = 10;  // ten times as fast: 3/10 < 2/1
  l = ChooseLink(links, 0, 4, 1, now);
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->id, 1u);
  links[0].load->inflight = 4;
  links[1].load->inflight = 4;
  EXPECT_EQ(ChooseLink(links, 0, 4, 0, now), nullptr);
}

// Near NICs first: a far idle link is taken only when no near one has room.
TEST(ChooseLink, NearLinksFirst) {
  std::vector<Link> links = Links(2);
  const absl::Time now = absl::Now();
  links[1].load->inflight = 2;
  const NicMask near = NicMask{1} << 1;  // link 2's NIC
  const Link* l = ChooseLink(links, near, 3, 0, now);
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->id, 2u);
  l = ChooseLink(links, near, 3, 0, now);  // now full: the far one
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->id, 1u);
}

// Copies of a link share its load (the segment's and the views').
TEST(ChooseLink, CopiesShareTheLoad) {
  std::vector<Link> links = Links(1);
  std::vector<Link> view = links;
  const absl::Time now = absl::Now();
  ASSERT_NE(ChooseLink(view, 0, 1, 0, now), nullptr);
  EXPECT_EQ(links[0].inflight(), 1u);
  EXPECT_EQ(ChooseLink(links, 0, 1, 0, now), nullptr);                        // full through either
  EXPECT_EQ(absl::ToUnixNanos(links[0].progress()), absl::ToUnixNanos(now));  // made busy now
}

// A batch's plan spreads its slices as ChooseLink would, one at a time,
// and takes every place at once; when other threads filled a link
// meanwhile, it takes nothing.
TEST(LinkPlan, PlansLikeChooseLinkAndTakesAllOrNothing) {
  std::vector<Link> links = Links(2);
  const absl::Time now = absl::Now();
  LinkPlan plan;
  ASSERT_TRUE(plan.Begin(&links, 4, /*start=*/1));
  EXPECT_EQ(plan.Next(0), 1);  // the start's link first
  EXPECT_EQ(plan.Next(0), 0);  // then the less loaded
  EXPECT_EQ(plan.Next(0), 1);
  EXPECT_EQ(links[0].inflight(), 0u);  // nothing taken yet
  ASSERT_TRUE(plan.Take(now));
  EXPECT_EQ(links[0].inflight(), 1u);
  EXPECT_EQ(links[1].inflight(), 2u);

  ASSERT_TRUE(plan.Begin(&links, 4, 0));
  for (int i = 0; i < 5; ++i) EXPECT_GE(plan.Next(0), 0);
  EXPECT_EQ(plan.Next(0), -1);   // both full as planned
  links[1].load->inflight += 2;  // another thread took link 1's places
  EXPECT_FALSE(plan.Take(now));
  EXPECT_EQ(links[0].inflight(), 1u);  // nothing of this plan stays
  EXPECT_EQ(links[1].inflight(), 4u);

  std::vector<Link> many = Links(LinkPlan::kMaxLinks + 1);
  EXPECT_FALSE(plan.Begin(&many, 4, 0));
}

// Places go back per link, counted.
TEST(LoadReturns, GivesBackPerLink) {
  std::vector<Link> links = Links(2);
  const absl::Time now = absl::Now();
  links[0].load->inflight = 3;
  links[1].load->inflight = 1;
  LoadReturns r;
  r.Add(links[0].load.get(), now);
  r.Add(links[1].load.get(), now);
  r.Add(links[0].load.get(), now);
  EXPECT_EQ(links[0].inflight(), 3u);  // at the flush
  r.Flush(now);
  EXPECT_EQ(links[0].inflight(), 1u);
  EXPECT_EQ(links[1].inflight(), 0u);
  links[1].load->Give(now, 5);  // never below zero
  EXPECT_EQ(links[1].inflight(), 0u);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
