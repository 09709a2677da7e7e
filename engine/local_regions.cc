#include "engine/local_regions.h"

#include <iterator>

#include "absl/strings/str_format.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

absl::Status LocalRegions::Register(void* addr, uint64_t length, transport::Access access,
                                    NicMask near) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null address or zero length");
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  {
    MutexLock lock(&mu_);
    auto next = by_addr_.lower_bound(base);
    const bool overlaps_next = next != by_addr_.end() && next->first - base < length;
    const bool overlaps_prev = next != by_addr_.begin() &&
                               std::prev(next)->first + std::prev(next)->second.region.length > base;
    if (overlaps_next || overlaps_prev) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterMemory: [%#x, +%u) overlaps a registered region", base, length));
    }
    // Reserved (id 0) so that a concurrent overlapping Register fails.
    Entry& e = by_addr_[base];
    e.region.addr = base;
    e.region.length = length;
  }
  absl::StatusOr<transport::Region> region = transport_->RegisterMemory(addr, length, access);
  MutexLock lock(&mu_);
  if (!region.ok()) {
    by_addr_.erase(base);
    return region.status();
  }
  Entry& e = by_addr_[base];
  e.region = std::move(*region);
  e.near = near;
  return absl::OkStatus();
}

absl::Status LocalRegions::Unregister(void* addr) {
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  transport::RegionId id;
  {
    MutexLock lock(&mu_);
    auto it = by_addr_.find(base);
    if (it == by_addr_.end() || it->second.region.id == 0) {
      return absl::NotFoundError(absl::StrFormat("no registered region starts at %p", addr));
    }
    id = it->second.region.id;
  }
  // Outside the lock: the transport may wait for peer writes in progress.
  absl::Status st = transport_->UnregisterMemory(id);
  if (!st.ok()) return st;
  MutexLock lock(&mu_);
  auto it = by_addr_.find(base);
  if (it != by_addr_.end() && it->second.region.id == id) by_addr_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<LocalUse> LocalRegions::Find(const void* addr, uint64_t length) const {
  const uint64_t a = reinterpret_cast<uintptr_t>(addr);
  MutexLock lock(&mu_);
  auto it = by_addr_.upper_bound(a);
  if (it != by_addr_.begin()) {
    --it;
    const Entry& e = it->second;
    if (e.region.id != 0 && length > 0 &&
        transport::RangeInside(a, length, e.region.addr, e.region.length)) {
      return LocalUse{e.region.id, e.near};
    }
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "local buffer [%p, +%u) is %s", addr, length,
      length == 0 ? "empty" : "not inside memory registered on this engine"));
}

std::vector<handshake::RegionDescriptor> LocalRegions::Advertised() const {
  std::vector<handshake::RegionDescriptor> out;
  MutexLock lock(&mu_);
  for (const auto& [addr, e] : by_addr_) {
    const transport::Region& r = e.region;
    if (r.id == 0 || r.access == transport::Access::kNone) continue;  // private: never advertised
    out.push_back(handshake::RegionDescriptor{r.addr, r.length, r.access, r.keys});
  }
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
