#include "engine/pipeline/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

using transport::Opcode;

bool Planner::Extend(const SegmentCore& seg, const TransferRequest& r, const LocalUse& local,
                     Slice* last) const {
  const uint64_t end = last->length + r.length;
  if (r.opcode != last->opcode || r.length == 0 || end > vias_[seg.via].slice_bytes ||
      r.local != static_cast<char*>(last->local) + last->length ||
      r.remote != last->remote + last->length || local.region != last->local_use.region ||
      reinterpret_cast<uintptr_t>(last->local) + end > last->local_use.until) {
    return false;
  }
  // The same peer region (whose access the first request was checked for).
  const handshake::RegionDescriptor& reg = seg.descriptor.regions[last->region];
  if (!transport::RangeInside(last->remote, end, reg.addr, reg.length)) return false;
  last->length = end;
  ++last->requests;
  return true;
}

absl::Status Planner::Cut(const SegmentCore& seg, SegmentId id, const TransferRequest& r, size_t i,
                          uint64_t off, LocalUse* use, const handshake::RegionDescriptor** reg,
                          Slice* out, SliceCheck* why) const {
  const uint64_t remote = r.remote + off;
  const uint64_t at = reinterpret_cast<uintptr_t>(r.local) + off;
  // The region of the previous slice goes on until its end.
  if (*reg == nullptr || remote - (*reg)->addr >= (*reg)->length) *reg = seg.FindRemote(remote);
  // Likewise the local piece (memory registered in pieces, see
  // LocalRegions); a buffer unregistered meanwhile is refused.
  if (at >= use->until && !regions_->FindPiece(at, use)) {
    *why = SliceCheck::kForbidden;
    return absl::InvalidArgumentError(
        absl::StrFormat("local buffer [%p, +%u) is no longer registered", r.local, r.length));
  }
  uint64_t len = std::min<uint64_t>(vias_[seg.via].slice_bytes, r.length - off);
  len = std::min<uint64_t>(len, use->until - at);
  if (*reg != nullptr) len = std::min<uint64_t>(len, (*reg)->addr + (*reg)->length - remote);
  absl::Status bad;
  *why = CheckRegion(seg, *reg, remote, len, r.opcode == Opcode::kWrite, &bad);
  if (*why != SliceCheck::kOk) return bad;
  Fill(seg, id, r, i, off, *use, *reg, len, out);
  return absl::OkStatus();
}

void Planner::Fill(const SegmentCore& seg, SegmentId id, const TransferRequest& r, size_t i,
                   uint64_t off, const LocalUse& use, const handshake::RegionDescriptor* reg,
                   uint64_t len, Slice* out) const {
  Slice& s = *out;
  s.request = i;
  s.requests = 1;
  s.segment = id;
  s.opcode = r.opcode;
  s.local = static_cast<char*>(r.local) + off;
  s.local_use = use;
  s.remote = r.remote + off;
  s.length = len;
  s.retries_left = retries_;
  s.checked = seg.generation + 1;
  s.region = static_cast<uint32_t>(reg - seg.descriptor.regions.data());
}

absl::Status Planner::Plan(const SegmentCore& seg, SegmentId id,
                           absl::Span<const TransferRequest> requests,
                           absl::Span<const LocalUse> local, std::vector<Slice>* planned,
                           SliceCheck* why) const {
  bool whole = false;  // planned->back() holds whole requests only
  // The peer region of the last slice: the next often lies in it too.
  const handshake::RegionDescriptor* reg = nullptr;
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransferRequest& r = requests[i];
    const LocalUse& first_piece = UseOf(local, i);
    if (first_piece.region[seg.via] == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("request ", i, ": its local buffer is GPU memory the ", vias_[seg.via].kind,
                       " NICs could not register (see the RegisterMemory warning), and peer ",
                       seg.peer, " is reached over ", vias_[seg.via].kind));
    }
    if (whole && Extend(seg, r, first_piece, &planned->back())) continue;
    LocalUse use = first_piece;
    for (uint64_t off = 0; off < r.length;) {
      Slice s;
      absl::Status cut = Cut(seg, id, r, i, off, &use, &reg, &s, why);
      if (!cut.ok()) return Annotate(cut, absl::StrCat("request ", i));
      whole = off == 0 && s.length == r.length;
      off += s.length;
      planned->push_back(s);
    }
  }
  return absl::OkStatus();
}

bool Planner::PlanLone(const SegmentCore& seg, SegmentId id, const TransferRequest& r,
                       const LocalUse& local, Slice* out) const {
  // A buffer the transport could not register, or one that ends past its
  // local piece: the general path explains, or cuts it.
  const uint64_t at = reinterpret_cast<uintptr_t>(r.local);
  if (local.region[seg.via] == 0 || at >= local.until || r.length > local.until - at) return false;
  // One slice, in one peer region that allows it: Cut's checks, without
  // building the message a refusal needs.
  if (r.length == 0 || r.length > vias_[seg.via].slice_bytes) return false;
  const handshake::RegionDescriptor* reg = seg.FindRemote(r.remote);
  if (!RegionAllows(seg, reg, r.remote, r.length, r.opcode == Opcode::kWrite)) return false;
  Fill(seg, id, r, 0, 0, local, reg, r.length, out);
  return true;
}

}  // namespace engine_internal
}  // namespace kvferry
