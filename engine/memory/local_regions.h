// The engine's registered memory: which local ranges requests may use, their
// regions on each of the engine's transports (the primary one, a TCP
// fallback and the same-host one, see EngineParts), and which local NICs of the primary
// transport are near each of them. Owns its state and its lock; the
// transports register outside the lock.
#ifndef KVFERRY_ENGINE_MEMORY_LOCAL_REGIONS_H_
#define KVFERRY_ENGINE_MEMORY_LOCAL_REGIONS_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "engine/types.h"
#include "handshake/messages.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// A set of local NICs, bit i for NIC i; 0 means "no preference" (NICs past
// the 64th are never preferred).
using NicMask = uint64_t;

// Transports an engine holds at most: the primary, a fallback and the
// same-host one (EngineParts).
constexpr size_t kMaxTransports = 3;

// A local buffer as a request uses it: the piece of registered memory
// holding its first byte (see LocalRegions), which ends at `until`.
struct LocalUse {
  std::array<transport::RegionId, kMaxTransports> region{};  // per transport
  NicMask near = 0;                                          // NICs of the primary transport
  uint64_t until = 0;  // the piece's end: slices past it use the next piece
};

// Request i's LocalUse in what LocalRegions::FindAll gave: one per request,
// or a single one for all.
inline const LocalUse& UseOf(absl::Span<const LocalUse> uses, size_t i) {
  return uses[uses.size() == 1 ? 0 : i];
}

class LocalRegions {
 public:
  // `transports`: the primary first; they outlive this.
  explicit LocalRegions(std::vector<transport::Transport*> transports);

  // Registers [addr, +length) with every transport (all or none), in pieces
  // no larger than any transport's Limits::max_region_bytes (a NIC's
  // max_mr_size), each its own region there and in descriptors; except
  // that GPU memory (`device`) the primary transport's NICs cannot register
  // (kFailedPrecondition: no dma-buf, no nvidia-peermem) stays registered
  // on the others, with a warning; requests over the primary then refuse it.
  // kInvalidArgument for a null or empty range or one that overlaps a
  // region (even one still being registered by another thread).
  absl::Status Register(void* addr, uint64_t length, transport::Access access, NicMask near,
                        bool device = false);
  // kNotFound when no region starts at `addr`; a transport's error (e.g.
  // kFailedPrecondition while requests use it) leaves it registered there,
  // unusable for new requests, and a later call finishes the job.
  absl::Status Unregister(void* addr);
  // The regions holding each request's local buffer, in order, looked up
  // under one lock; kInvalidArgument naming the first request whose buffer
  // is empty or outside registered memory. A buffer may span pieces of one
  // registration: its LocalUse is its first byte's piece. Each thread keeps
  // the last piece it found: requests inside it take no lock while no
  // registration changed since (a submit path's usual case), and `out` then
  // gets one LocalUse that stands for every request (see UseOf).
  absl::Status FindAll(absl::Span<const TransferRequest> requests,
                       std::vector<LocalUse>* out) const;
  // FindAll for one request, into `out`.
  absl::Status FindOne(const TransferRequest& r, LocalUse* out) const;
  // The piece holding `addr` (for a request's bytes past its first piece);
  // false when it is no longer registered.
  bool FindPiece(uint64_t addr, LocalUse* out) const;
  // Where the usable registration holding all of [addr, +length) ends, or 0
  // when none holds it (a prepared list's check, done once).
  uint64_t RegistrationEnd(uint64_t addr, uint64_t length) const;
  // Bumped whenever a registration changes: what was looked up under an
  // older value may be stale.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // The regions peers may use through transport `index`, for its descriptor.
  std::vector<handshake::RegionDescriptor> Advertised(size_t index) const;

 private:
  // One piece of a registration, registered on every transport.
  struct Piece {
    uint64_t addr = 0;
    uint64_t length = 0;
    // Per transport; empty while they register it, an id 0 once one
    // unregistered it.
    std::vector<transport::Region> regions;
  };
  struct Entry {
    uint64_t length = 0;
    transport::Access access = transport::Access::kNone;
    std::vector<Piece> pieces;  // in address order; empty while registering
    uint64_t piece_bytes = 0;   // every piece's length but the last's
    uint32_t absent = 0;        // transports that could not register it (bit i), id 0 there
    NicMask near = 0;
    bool usable() const {
      if (pieces.empty()) return false;
      for (const Piece& p : pieces) {
        if (p.regions.empty()) return false;
        for (size_t i = 0; i < p.regions.size(); ++i) {
          if (p.regions[i].id == 0 && ((absent >> i) & 1) == 0) return false;
        }
      }
      return true;
    }
    // The index of the piece holding `addr` (the registration starts at `base`).
    size_t PieceOf(uint64_t base, uint64_t addr) const {
      return std::min<size_t>((addr - base) / piece_bytes, pieces.size() - 1);
    }
    LocalUse Use(uint64_t base, uint64_t addr) const;
  };
  // Registers `e`'s pieces of [base, +length) on every transport; on failure
  // none stays registered.
  absl::Status RegisterPieces(uint64_t base, uint64_t length, transport::Access access, bool device,
                              std::vector<Piece>* pieces, uint32_t* absent);
  // The entry holding [addr, +length) that requests may use, or null.
  // `*base`: where its registration starts.
  const Entry* Lookup(uint64_t addr, uint64_t length, uint64_t* base) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A registration changed (under mu_): threads' cached pieces are stale.
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    generation_.fetch_add(1, std::memory_order_release);
  }
  // FindAll under the lock; caches the last piece found for this thread.
  absl::Status FindAllLocked(absl::Span<const TransferRequest> requests,
                             std::vector<LocalUse>* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Request `i` (`r`) of FindAllLocked; `last`: cache its piece.
  absl::Status FindLocked(const TransferRequest& r, size_t i, bool last, LocalUse* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `r` lies in this thread's cached piece (of this instance, with
  // no registration changed since).
  bool InCachedPiece(const TransferRequest& r) const;
  const std::vector<transport::Transport*> transports_;
  // This instance among the process's (threads' caches name it).
  const uint64_t serial_;
  std::atomic<uint64_t> generation_{1};
  mutable Mutex mu_;
  std::map<uint64_t, Entry> by_addr_ ABSL_GUARDED_BY(mu_);
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_MEMORY_LOCAL_REGIONS_H_
