#include "engine/memory/local_regions.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status_macros.h"
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
      return absl::InvalidArgumentError(
          absl::StrFormat("RegisterMemory: [%#x, +%u) overlaps a registered region", base, length));
    }
    // Reserved (no pieces yet) so that a concurrent overlapping Register fails.
    Entry& e = by_addr_[base];
    e.length = length;
    e.access = access;
  }
  std::vector<Piece> pieces;
  uint32_t absent = 0;
  absl::Status failed = RegisterPieces(base, length, access, device, &pieces, &absent);
  MutexLock lock(&mu_);
  if (!failed.ok()) {
    by_addr_.erase(base);
    return failed;
  }
  Entry& e = by_addr_[base];
  e.piece_bytes = pieces.front().length;
  e.pieces = std::move(pieces);
  e.absent = absent;
  e.near = near;
  Changed();
  return absl::OkStatus();
}

absl::Status LocalRegions::RegisterPieces(uint64_t base, uint64_t length, transport::Access access,
                                          bool device, std::vector<Piece>* pieces,
                                          uint32_t* absent) {
  uint64_t piece_bytes = length;
  for (transport::Transport* t : transports_) {
    const uint64_t limit = t->GetLimits().max_region_bytes;
    if (limit > 0) piece_bytes = std::min(piece_bytes, limit);
  }
  if (piece_bytes < length) {
    KVF_LOG(INFO) << "RegisterMemory: " << length << " bytes registered in "
                  << (length + piece_bytes - 1) / piece_bytes << " pieces of at most "
                  << piece_bytes << " (the largest region a transport takes)";
  }
  absl::Status failed;
  for (uint64_t off = 0; off < length && failed.ok(); off += piece_bytes) {
    Piece& p = pieces->emplace_back();
    p.addr = base + off;
    p.length = std::min(piece_bytes, length - off);
    void* at = reinterpret_cast<void*>(p.addr);
    for (size_t i = 0; i < transports_.size(); ++i) {
      if (((*absent >> i) & 1) != 0) {
        p.regions.emplace_back();  // id 0: not on this transport
        continue;
      }
      absl::StatusOr<transport::Region> r = transports_[i]->RegisterMemory(at, p.length, access);
      if (!r.ok() && device && i == 0 && off == 0 && transports_.size() > 1 &&
          r.status().code() == absl::StatusCode::kFailedPrecondition) {
        KVF_LOG(WARNING) << "RegisterMemory: " << r.status().message()
                         << "; kept on the fallback transport: peers reached over it can use it, "
                            "requests over the primary refuse it";
        *absent |= 1;
        p.regions.emplace_back();  // id 0
        continue;
      }
      if (!r.ok()) {
        failed = r.status();
        break;
      }
      p.regions.push_back(std::move(*r));
    }
  }
  if (!failed.ok()) {
    for (const Piece& p : *pieces) {
      for (size_t i = 0; i < p.regions.size(); ++i) {
        if (p.regions[i].id != 0) (void)transports_[i]->UnregisterMemory(p.regions[i].id);
      }
    }
  }
  return failed;
}

absl::Status LocalRegions::Unregister(void* addr) {
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  std::vector<std::vector<transport::RegionId>> ids;  // per piece, per transport
  {
    MutexLock lock(&mu_);
    auto it = by_addr_.find(base);
    if (it == by_addr_.end() || it->second.pieces.empty()) {
      return absl::NotFoundError(absl::StrFormat("no registered region starts at %p", addr));
    }
    for (const Piece& p : it->second.pieces) {
      std::vector<transport::RegionId>& piece_ids = ids.emplace_back();
      for (const transport::Region& r : p.regions) piece_ids.push_back(r.id);
    }
  }
  // Outside the lock: a transport may wait for peer writes in progress.
  for (size_t k = 0; k < ids.size(); ++k) {
    for (size_t i = 0; i < ids[k].size(); ++i) {
      if (ids[k][i] == 0) continue;  // gone there already (an earlier call)
      absl::Status st = transports_[i]->UnregisterMemory(ids[k][i]);
      if (!st.ok()) return st;
      MutexLock lock(&mu_);
      auto it = by_addr_.find(base);
      if (it != by_addr_.end() && it->second.pieces[k].regions[i].id == ids[k][i]) {
        it->second.pieces[k].regions[i].id = 0;
        Changed();
      }
    }
  }
  MutexLock lock(&mu_);
  auto it = by_addr_.find(base);
  if (it != by_addr_.end() && !it->second.pieces.empty() &&
      std::all_of(it->second.pieces.begin(), it->second.pieces.end(), [](const Piece& p) {
        return std::all_of(p.regions.begin(), p.regions.end(),
                           [](const transport::Region& r) { return r.id == 0; });
      })) {
    by_addr_.erase(it);
    Changed();
  }
  return absl::OkStatus();
}

LocalUse LocalRegions::Entry::Use(uint64_t base, uint64_t addr) const {
  const Piece& p = pieces[PieceOf(base, addr)];
  LocalUse use;
  for (size_t t = 0; t < p.regions.size() && t < kMaxTransports; ++t) {
    use.region[t] = p.regions[t].id;
  }
  use.near = near;
  use.until = p.addr + p.length;
  return use;
}

const LocalRegions::Entry* LocalRegions::Lookup(uint64_t addr, uint64_t length,
                                                uint64_t* base) const {
  auto it = by_addr_.upper_bound(addr);
  if (it == by_addr_.begin()) return nullptr;
  --it;
  const Entry& e = it->second;
  *base = it->first;
  return e.usable() && length > 0 && transport::RangeInside(addr, length, it->first, e.length)
             ? &e
             : nullptr;
}

namespace {

// The piece a thread found last, of which instance, and when.
struct CachedPiece {
  uint64_t serial = 0;  // 0: none
  uint64_t generation = 0;
  uint64_t base = 0;  // its registration: [base, +length)
  uint64_t length = 0;
  uint64_t from = 0;  // the piece: [from, use.until)
  LocalUse use;
};
thread_local CachedPiece cached_piece;

std::atomic<uint64_t> next_serial{1};

}  // namespace

LocalRegions::LocalRegions(std::vector<transport::Transport*> transports)
    : transports_(std::move(transports)), serial_(next_serial.fetch_add(1)) {}

bool LocalRegions::InCachedPiece(const TransferRequest& r) const {
  const CachedPiece& c = cached_piece;
  const uint64_t at = reinterpret_cast<uintptr_t>(r.local);
  return c.serial == serial_ && c.generation == generation_.load(std::memory_order_acquire) &&
         r.length > 0 && transport::RangeInside(at, r.length, c.base, c.length) && at >= c.from &&
         at < c.use.until;
}

absl::Status LocalRegions::FindAll(absl::Span<const TransferRequest> requests,
                                   std::vector<LocalUse>* out) const {
  bool hit = true;
  for (size_t i = 0; hit && i < requests.size(); ++i) hit = InCachedPiece(requests[i]);
  if (hit) {
    out->push_back(cached_piece.use);  // one for all
    return absl::OkStatus();
  }
  MutexLock lock(&mu_);
  return FindAllLocked(requests, out);
}

absl::Status LocalRegions::FindOne(const TransferRequest& r, LocalUse* out) const {
  if (InCachedPiece(r)) {
    *out = cached_piece.use;
    return absl::OkStatus();
  }
  MutexLock lock(&mu_);
  return FindLocked(r, 0, /*last=*/true, out);
}

absl::Status LocalRegions::FindAllLocked(absl::Span<const TransferRequest> requests,
                                         std::vector<LocalUse>* out) const {
  for (size_t i = 0; i < requests.size(); ++i) {
    LocalUse use;
    RETURN_IF_ERROR(FindLocked(requests[i], i, i + 1 == requests.size(), &use));
    out->push_back(use);
  }
  return absl::OkStatus();
}

absl::Status LocalRegions::FindLocked(const TransferRequest& r, size_t i, bool last,
                                      LocalUse* out) const {
  const uint64_t at = reinterpret_cast<uintptr_t>(r.local);
  uint64_t base = 0;
  const Entry* e = Lookup(at, r.length, &base);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("request %u: local buffer [%p, +%u) is %s", i, r.local, r.length,
                        r.length == 0 ? "empty" : "not inside memory registered on this engine"));
  }
  *out = e->Use(base, at);
  if (last) {
    cached_piece = CachedPiece{serial_,   generation_.load(std::memory_order_relaxed), base,
                               e->length, e->pieces[e->PieceOf(base, at)].addr,        *out};
  }
  return absl::OkStatus();
}

bool LocalRegions::FindPiece(uint64_t addr, LocalUse* out) const {
  MutexLock lock(&mu_);
  uint64_t base = 0;
  const Entry* e = Lookup(addr, 1, &base);
  if (e == nullptr) return false;
  *out = e->Use(base, addr);
  return true;
}

uint64_t LocalRegions::RegistrationEnd(uint64_t addr, uint64_t length) const {
  MutexLock lock(&mu_);
  uint64_t base = 0;
  const Entry* e = Lookup(addr, length, &base);
  return e == nullptr ? 0 : base + e->length;
}

std::vector<handshake::RegionDescriptor> LocalRegions::Advertised(size_t index) const {
  std::vector<handshake::RegionDescriptor> out;
  MutexLock lock(&mu_);
  for (const auto& [addr, e] : by_addr_) {
    if (!e.usable() || ((e.absent >> index) & 1) != 0) continue;
    for (const Piece& p : e.pieces) {  // each piece its own region
      if (index >= p.regions.size()) continue;
      const transport::Region& r = p.regions[index];
      if (r.access == transport::Access::kNone) continue;  // private: never advertised
      out.push_back(handshake::RegionDescriptor{r.addr, r.length, r.access, r.keys});
    }
  }
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
