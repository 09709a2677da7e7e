#include "engine/peer/notifications.h"

#include "gtest/gtest.h"

namespace kvferry {
namespace engine_internal {
namespace {

TEST(InboxTest, BoundedInCountAndBytesAndFreedAsTaken) {
  Inbox inbox(nullptr, /*max_count=*/3, /*max_bytes=*/10);
  EXPECT_TRUE(inbox.Push(Notification{1, "aaaa"}).ok());
  EXPECT_TRUE(inbox.Push(Notification{1, "bbbb"}).ok());
  // 8 + 4 bytes would pass the byte cap.
  EXPECT_EQ(inbox.Push(Notification{1, "cccc"}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(inbox.Push(Notification{1, "cc"}).ok());
  // Three held: the count cap.
  EXPECT_EQ(inbox.Push(Notification{1, ""}).code(), absl::StatusCode::kResourceExhausted);
  auto first = inbox.Next(absl::ZeroDuration());
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->message, "aaaa");
  EXPECT_TRUE(inbox.Push(Notification{1, "dddd"}).ok());  // room again
  EXPECT_EQ(inbox.TakeAll().size(), 3u);
  EXPECT_TRUE(inbox.Push(Notification{1, "eeeeeeeeee"}).ok());
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
