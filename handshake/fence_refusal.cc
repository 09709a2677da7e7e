// The refusal an engine gives a peer instance it fenced (messages.h,
// FencedError), and reading its epoch back.
#include <cstdint>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "handshake/messages.h"

namespace kvferry {
namespace handshake {

namespace {
constexpr absl::string_view kFenceMark = " [fence epoch ";
}  // namespace

absl::Status FencedError(absl::string_view message, uint64_t epoch) {
  return absl::FailedPreconditionError(absl::StrCat(message, kFenceMark, epoch, "]"));
}

std::optional<uint64_t> FencedEpoch(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kFailedPrecondition) return std::nullopt;
  absl::string_view m = status.message();
  const size_t at = m.rfind(kFenceMark);
  if (at == absl::string_view::npos || !absl::EndsWith(m, "]")) return std::nullopt;
  m = m.substr(at + kFenceMark.size());
  m.remove_suffix(1);
  uint64_t epoch = 0;
  if (m.empty() || m.size() > 20 || !absl::SimpleAtoi(m, &epoch)) return std::nullopt;
  // The peer's client takes epoch + 1: the last one never comes.
  if (epoch == UINT64_MAX) return std::nullopt;
  return epoch;
}

}  // namespace handshake
}  // namespace kvferry
