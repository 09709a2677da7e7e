#include "transport/checks.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/scratch.h"

namespace kvferry {
namespace transport {

absl::Status CheckLocal(const WorkRequest& wr, const Region& r, uint64_t max_bytes) {
  if (wr.opcode != Opcode::kWrite && wr.opcode != Opcode::kRead) {
    return absl::InvalidArgumentError("unknown opcode");
  }
  if (wr.length > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request of ", wr.length, " bytes exceeds the limit of ", max_bytes));
  }
  const uint64_t addr = reinterpret_cast<uintptr_t>(wr.local_addr);
  if (wr.length > 0 && !RangeInside(addr, wr.length, r.addr, r.length)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "local range [%#x, +%u) lies outside region %u [%#x, +%u)", addr, wr.length, r.id,
        r.addr, r.length));
  }
  return absl::OkStatus();
}

namespace {

absl::Status OverCapacity(LinkId link, size_t total, uint32_t limit) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "link ", link, " would have ", total, " outstanding requests; the limit is ", limit));
}

}  // namespace

absl::Status CheckLinkCapacity(absl::Span<const WorkRequest> batch,
                               absl::FunctionRef<size_t(LinkId)> outstanding, uint32_t limit) {
  if (batch.empty()) return absl::OkStatus();
  // Every request on one link (a one-request batch, a chain): one count.
  const LinkId first = batch[0].link;
  bool one_link = true;
  for (const WorkRequest& wr : batch) one_link = one_link && wr.link == first;
  if (one_link) {
    const size_t total = outstanding(first) + batch.size();
    return total > limit ? OverCapacity(first, total, limit) : absl::OkStatus();
  }
  Scratch<std::pair<LinkId, size_t>> per_link_scratch;  // no allocation once warm
  std::vector<std::pair<LinkId, size_t>>& per_link = *per_link_scratch;  // few links
  for (const WorkRequest& wr : batch) {
    auto it = per_link.begin();
    while (it != per_link.end() && it->first != wr.link) ++it;
    if (it == per_link.end()) {
      per_link.emplace_back(wr.link, 1);
    } else {
      ++it->second;
    }
  }
  for (const auto& [link, count] : per_link) {
    const size_t total = outstanding(link) + count;
    if (total > limit) return OverCapacity(link, total, limit);
  }
  return absl::OkStatus();
}

absl::Status CheckRemoteAccess(const Region& r, Opcode opcode, uint64_t addr,
                               uint64_t length) {
  const bool write = opcode == Opcode::kWrite;
  if (write ? !AllowsRemoteWrite(r.access) : !AllowsRemoteRead(r.access)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "remote access error: region does not allow remote ", write ? "write" : "read"));
  }
  if (!RangeInside(addr, length, r.addr, r.length)) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "remote access error: range [%#x, +%u) outside region [%#x, +%u)", addr, length,
        r.addr, r.length));
  }
  return absl::OkStatus();
}

absl::Status CheckLinkUsable(LinkId link, const LinkState* state) {
  if (state == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown link ", link));
  switch (*state) {
    case LinkState::kPending:
      return absl::FailedPreconditionError(absl::StrCat("link ", link, " is not established"));
    case LinkState::kError:
      return absl::FailedPreconditionError(
          absl::StrCat("link ", link, " is in the error state; open a new one"));
    case LinkState::kReady:
      break;
  }
  return absl::OkStatus();
}

absl::Status UnknownKeyError(RemoteKey key) {
  return absl::PermissionDeniedError(
      absl::StrFormat("remote access error: unknown key %#x", key));
}

}  // namespace transport
}  // namespace kvferry
