// Checks every Transport implementation makes the same way, with the same
// status codes and messages: local ranges on Post, per-link queue limits,
// and the responder's key/access/bounds check.
#ifndef KVFERRY_TRANSPORT_CHECKS_H_
#define KVFERRY_TRANSPORT_CHECKS_H_

#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

// True if [addr, addr+len) lies inside [base, base+size), without overflow.
inline bool RangeInside(uint64_t addr, uint64_t len, uint64_t base, uint64_t size) {
  return addr >= base && len <= size && addr - base <= size - len;
}

// The local half of a request: opcode known, length within `max_bytes`, and
// a non-empty local range inside `region` (kInvalidArgument otherwise;
// kResourceExhausted above the size limit).
absl::Status CheckLocal(const WorkRequest& wr, const Region& region, uint64_t max_bytes);

// kResourceExhausted if posting `batch` would put more than `limit`
// requests outstanding on any link; `outstanding(link)` says how many it has.
absl::Status CheckLinkCapacity(absl::Span<const WorkRequest> batch,
                               absl::FunctionRef<size_t(LinkId)> outstanding, uint32_t limit);

// The responder's check of a peer's request against the region its key
// named: access rights, then bounds. kPermissionDenied ("remote access
// error: ...") when refused.
absl::Status CheckRemoteAccess(const Region& region, Opcode opcode, uint64_t addr,
                               uint64_t length);
// kPermissionDenied for a key that names no region.
absl::Status UnknownKeyError(RemoteKey key);

// A link's state, the same in every transport: set up but not yet
// established (CreateLink done, CompleteLink not), established, or in error
// (RC semantics: no more requests on it; close it).
enum class LinkState { kPending, kReady, kError };
// Post's check of the link a request names (`state` null: no such link):
// kInvalidArgument for an unknown link, kFailedPrecondition for one not
// established or in error.
absl::Status CheckLinkUsable(LinkId link, const LinkState* state);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_CHECKS_H_
