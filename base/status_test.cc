#include <cerrno>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

absl::Status FailIf(bool fail) {
  return fail ? absl::NotFoundError("gone") : absl::OkStatus();
}

absl::Status Chain(bool fail, int* reached) {
  RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return absl::OkStatus();
}

absl::Status ChainCtx(bool fail) {
  RETURN_IF_ERROR_CTX(FailIf(fail), "opening peer 10.0.0.1:15000");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool fail) {
  if (fail) return absl::UnavailableError("no");
  return std::make_unique<int>(7);
}

absl::StatusOr<int> UseInt(bool fail) {
  ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeInt(fail));  // move-only
  ASSIGN_OR_RETURN(auto q, MakeInt(false));                 // twice per scope
  return *p + *q;
}

TEST(StatusMacros, ReturnIfErrorPropagatesAndContinues) {
  int reached = 0;
  EXPECT_EQ(Chain(true, &reached).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, ContextKeepsCodeAndPrefixesMessage) {
  absl::Status s = ChainCtx(true);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "opening peer 10.0.0.1:15000: gone");
  EXPECT_TRUE(ChainCtx(false).ok());
}

TEST(StatusMacros, AssignOrReturn) {
  absl::StatusOr<int> bad = UseInt(true);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<int> good = UseInt(false);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 14);
}

TEST(ErrnoStatus, MapsCodesAndCarriesContext) {
  absl::Status s = ErrnoError(ECONNREFUSED, "connect 127.0.0.1:1");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            "connect 127.0.0.1:1: Connection refused (errno " +
                std::to_string(ECONNREFUSED) + ")");
  EXPECT_EQ(ErrnoToCode(ETIMEDOUT), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ErrnoToCode(EACCES), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToCode(ENOMEM), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToCode(EINVAL), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoToCode(ENOSYS), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ErrnoToCode(EADDRINUSE), absl::StatusCode::kAlreadyExists);
}

TEST(ErrnoStatus, ZeroErrnoIsNotOk) {
  EXPECT_FALSE(ErrnoError(0, "x").ok());
}

TEST(ErrnoStatus, LastErrnoReadsErrno) {
  errno = ENOENT;
  absl::Status s = LastErrnoError("open /sys/class/infiniband");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("/sys/class/infiniband: No such file"),
            absl::string_view::npos);
}

TEST(Annotate, OkStaysOk) {
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
  EXPECT_EQ(Annotate(absl::InternalError("m"), "").message(), "m");
}

}  // namespace
}  // namespace kvferry
