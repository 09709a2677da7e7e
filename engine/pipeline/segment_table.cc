#include "engine/pipeline/segment_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

const handshake::RegionDescriptor* SegmentCore::FindRemote(uint64_t addr) const {
  const auto& regions = descriptor.regions;
  auto it =
      std::upper_bound(regions.begin(), regions.end(), addr,
                       [](uint64_t a, const handshake::RegionDescriptor& r) { return a < r.addr; });
  if (it == regions.begin()) return nullptr;
  --it;
  return addr - it->addr < it->length ? &*it : nullptr;
}

SliceCheck CheckRemote(const SegmentCore& seg, uint64_t remote, uint64_t length, bool write,
                       absl::Status* error, const handshake::RegionDescriptor** region) {
  return CheckRegion(seg, seg.FindRemote(remote), remote, length, write, error, region);
}

SliceCheck CheckRegion(const SegmentCore& seg, const handshake::RegionDescriptor* found,
                       uint64_t remote, uint64_t length, bool write, absl::Status* error,
                       const handshake::RegionDescriptor** region) {
  if (region != nullptr) *region = found;
  if (RegionAllows(seg, found, remote, length, write)) return SliceCheck::kOk;
  if (found == nullptr || !transport::RangeInside(remote, length, found->addr, found->length)) {
    *error = absl::InvalidArgumentError(absl::StrFormat(
        "peer %s has no registered region covering [%#x, +%u) (it advertises %u region(s))",
        seg.peer, remote, length, seg.descriptor.regions.size()));
    return SliceCheck::kOutsideRegions;
  }
  if (write ? !transport::AllowsRemoteWrite(found->access)
            : !transport::AllowsRemoteRead(found->access)) {
    *error = absl::PermissionDeniedError(absl::StrFormat(
        "peer %s does not allow remote %s of [%#x, +%u): it registered that memory without %s "
        "access (the peer chooses: RegisterMemory's access; in Python "
        "register_memory(access=\"rw\") "
        "or KVFERRY_REMOTE_ACCESS=rw in the peer's environment)",
        seg.peer, write ? "write" : "read", remote, length, write ? "write" : "read"));
    return SliceCheck::kForbidden;
  }
  if (seg.links.empty()) {
    *error = absl::UnavailableError(absl::StrCat("no links to ", seg.peer));
    return SliceCheck::kNoLinks;
  }
  return SliceCheck::kOk;
}

void Segment::Publish() {
  shared->view = state == SegmentState::kReady
                     ? std::make_shared<const SegmentCore>(static_cast<const SegmentCore&>(*this))
                     : nullptr;
  // Release: a thread that sees the new version under the pipeline's lock
  // or its lane's sees the view (both are read under the pipeline's lock).
  shared->version.fetch_add(1, std::memory_order_release);
}

Segment* SegmentTable::Find(SegmentId id) {
  if (id == last_found_id_) return last_found_;
  auto it = segments_.find(id);
  if (it == segments_.end()) return nullptr;
  last_found_id_ = id;
  last_found_ = &it->second;
  return last_found_;
}

const Segment* SegmentTable::Find(SegmentId id) const {
  auto it = segments_.find(id);
  return it == segments_.end() ? nullptr : &it->second;
}

SegmentId SegmentTable::ByPeer(const std::string& peer) const {
  auto it = by_peer_.find(peer);
  return it == by_peer_.end() ? 0 : it->second;
}

SegmentId SegmentTable::Add(Segment segment) {
  const SegmentId id = ++last_;
  by_peer_[segment.peer] = id;
  segments_.emplace(id, std::move(segment));
  return id;
}

void SegmentTable::Remove(SegmentId id) {
  auto it = segments_.find(id);
  if (it == segments_.end()) return;
  by_peer_.erase(it->second.peer);
  segments_.erase(it);
  last_found_id_ = 0;
  last_found_ = nullptr;
}

}  // namespace engine_internal
}  // namespace kvferry
