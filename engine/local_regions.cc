#include "engine/local_regions.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

absl::Status LocalRegions::Register(void* addr, uint64_t length, transport::Access access,
                                    NicMask near, bool device) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null address or zero length");
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  {
    MutexLock lock(&mu_);
    auto next = by_addr_.lower_bound(base);
    const bool overlaps_next = next != by_addr_.end() && next->first - base < length;
    const bool overlaps_prev =
        next != by_addr_.begin() && std::prev(next)->first + std::prev(next)->second.length > base;
    if (overlaps_next || overlaps_prev) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterMemory: [%#x, +%u) overlaps a registered region", base, length));
    }
    // Reserved (no regions yet) so that a concurrent overlapping Register fails.
    Entry& e = by_addr_[base];
    e.length = length;
    e.access = access;
  }
  std::vector<transport::Region> regions;
  absl::Status failed;
  uint32_t absent = 0;
  for (size_t i = 0; i < transports_.size(); ++i) {
    absl::StatusOr<transport::Region> r = transports_[i]->RegisterMemory(addr, length, access);
    if (!r.ok() && device && i == 0 && transports_.size() > 1 &&
        r.status().code() == absl::StatusCode::kFailedPrecondition) {
      KVF_LOG(WARNING) << "RegisterMemory: " << r.status().message()
                       << "; kept on the fallback transport: peers reached over it can use it, "
                          "requests over the primary refuse it";
      absent |= 1;
      regions.emplace_back();  // id 0
      continue;
    }
    if (!r.ok()) {
      failed = r.status();
      break;
    }
    regions.push_back(std::move(*r));
  }
  if (!failed.ok()) {
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].id != 0) (void)transports_[i]->UnregisterMemory(regions[i].id);
    }
  }
  MutexLock lock(&mu_);
  if (!failed.ok()) {
    by_addr_.erase(base);
    return failed;
  }
  Entry& e = by_addr_[base];
  e.regions = std::move(regions);
  e.absent = absent;
  e.near = near;
  return absl::OkStatus();
}

absl::Status LocalRegions::Unregister(void* addr) {
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  std::vector<transport::RegionId> ids;
  {
    MutexLock lock(&mu_);
    auto it = by_addr_.find(base);
    if (it == by_addr_.end() || it->second.regions.empty()) {
      return absl::NotFoundError(absl::StrFormat("no registered region starts at %p", addr));
    }
    for (const transport::Region& r : it->second.regions) ids.push_back(r.id);
  }
  // Outside the lock: a transport may wait for peer writes in progress.
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == 0) continue;  // gone there already (an earlier call)
    absl::Status st = transports_[i]->UnregisterMemory(ids[i]);
    if (!st.ok()) return st;
    MutexLock lock(&mu_);
    auto it = by_addr_.find(base);
    if (it != by_addr_.end() && it->second.regions[i].id == ids[i]) it->second.regions[i].id = 0;
  }
  MutexLock lock(&mu_);
  auto it = by_addr_.find(base);
  if (it != by_addr_.end() && !it->second.regions.empty() &&
      std::all_of(it->second.regions.begin(), it->second.regions.end(),
                  [](const transport::Region& r) { return r.id == 0; })) {
    by_addr_.erase(it);
  }
  return absl::OkStatus();
}

const LocalRegions::Entry* LocalRegions::Lookup(uint64_t addr, uint64_t length) const {
  auto it = by_addr_.upper_bound(addr);
  if (it == by_addr_.begin()) return nullptr;
  --it;
  const Entry& e = it->second;
  return e.usable() && length > 0 && transport::RangeInside(addr, length, it->first, e.length)
             ? &e
             : nullptr;
}

absl::Status LocalRegions::FindAll(absl::Span<const TransferRequest> requests,
                                   std::vector<LocalUse>* out) const {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransferRequest& r = requests[i];
    const Entry* e = Lookup(reinterpret_cast<uintptr_t>(r.local), r.length);
    if (e == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "request %u: local buffer [%p, +%u) is %s", i, r.local, r.length,
          r.length == 0 ? "empty" : "not inside memory registered on this engine"));
    }
    LocalUse use;
    for (size_t t = 0; t < e->regions.size() && t < kMaxTransports; ++t) {
      use.region[t] = e->regions[t].id;
    }
    use.near = e->near;
    out->push_back(use);
  }
  return absl::OkStatus();
}

std::vector<handshake::RegionDescriptor> LocalRegions::Advertised(size_t index) const {
  std::vector<handshake::RegionDescriptor> out;
  MutexLock lock(&mu_);
  for (const auto& [addr, e] : by_addr_) {
    if (!e.usable() || index >= e.regions.size() || ((e.absent >> index) & 1) != 0) continue;
    const transport::Region& r = e.regions[index];
    if (r.access == transport::Access::kNone) continue;  // private: never advertised
    out.push_back(handshake::RegionDescriptor{r.addr, r.length, r.access, r.keys});
  }
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
