#include "transport/link_params.h"

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace {

TEST(LinkParams, RoundTrip) {
  const std::string gid(16, '\x7f');
  const std::string bytes =
      LinkParams("verbs").Put(1, 0x1a2).Put(2, 0).Put(3, UINT64_MAX).PutBytes(4, gid).Encode();
  auto p = LinkParams::Decode(bytes, "verbs");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p->Get(1, "qpn"), 0x1a2u);
  EXPECT_EQ(*p->Get(2, "psn"), 0u);
  EXPECT_EQ(*p->Get(3, "x"), UINT64_MAX);
  EXPECT_EQ(*p->GetBytes(4, 16, "gid"), gid);
}

TEST(LinkParams, RefusesWhatItCannotRead) {
  const std::string good = LinkParams("tcp").Put(1, 42).Encode();
  auto code = [](const absl::StatusOr<LinkParams>& p) { return p.status().code(); };
  EXPECT_EQ(code(LinkParams::Decode("", "tcp")), absl::StatusCode::kInvalidArgument);
  auto other_kind = LinkParams::Decode(good, "verbs");
  EXPECT_EQ(code(other_kind), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other_kind.status().message().find("made by the tcp transport"), std::string::npos);
  std::string newer = good;
  newer[0] = 2;
  auto version = LinkParams::Decode(newer, "tcp");
  EXPECT_NE(version.status().message().find("version 2"), std::string::npos);
  // Cut inside the header or inside a field; cut between fields, what is
  // left is a valid set without them.
  const size_t header = 2 + 3;
  for (size_t cut = 1; cut < good.size(); ++cut) {
    if (cut == header) continue;
    EXPECT_FALSE(LinkParams::Decode(good.substr(0, cut), "tcp").ok()) << cut;
  }
  auto empty = LinkParams::Decode(good.substr(0, header), "tcp");
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->Get(1, "token").ok());
  const std::string twice = LinkParams("tcp").Put(1, 1).Put(1, 2).Encode();
  EXPECT_EQ(code(LinkParams::Decode(twice, "tcp")), absl::StatusCode::kInvalidArgument);
  auto p = LinkParams::Decode(good, "tcp");
  ASSERT_TRUE(p.ok());
  auto missing = p->Get(2, "in-process key");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("no in-process key"), std::string::npos);
  EXPECT_FALSE(p->GetBytes(1, 16, "gid").ok());
}

TEST(LinkParams, KindOfRoutesToTheTransport) {
  EXPECT_EQ(*LinkParams::KindOf(LinkParams("verbs").Put(1, 2).Encode()), "verbs");
  EXPECT_FALSE(LinkParams::KindOf("").ok());
  EXPECT_FALSE(LinkParams::KindOf(std::string("\x01\x09tc", 4)).ok());
}

TEST(LinkParams, UnknownFieldsAreSkipped) {
  const std::string bytes = LinkParams("sim").Put(9, 7).Put(1, 5).PutBytes(200, "later").Encode();
  auto p = LinkParams::Decode(bytes, "sim");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p->Get(1, "qpn"), 5u);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
