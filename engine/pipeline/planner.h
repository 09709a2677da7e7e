// The planner: cuts a batch's requests into slices, each checked against
// the peer's advertised regions and inside one local piece, and merges
// adjacent whole requests into one slice. One cut serves the general path
// and the lone request's short one (Submit), so both check alike. Reads
// only what it is given: no lock of its own.
#ifndef KVFERRY_ENGINE_PIPELINE_PLANNER_H_
#define KVFERRY_ENGINE_PIPELINE_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/memory/local_regions.h"
#include "engine/pipeline/batch_table.h"
#include "engine/pipeline/segment_table.h"
#include "engine/pipeline/vias.h"

namespace kvferry {
namespace engine_internal {

class Planner {
 public:
  // Both outlive it; `retries`: what each slice starts with.
  Planner(const std::vector<Via>* vias, const LocalRegions* regions, uint32_t retries)
      : vias_(*vias), regions_(regions), retries_(retries) {}

  // Cuts every request into slices that never cross the end of a peer
  // region or of a local piece, and checks them all; `why` says what was
  // wrong (kOutsideRegions: the caller may look at the peer again).
  absl::Status Plan(const SegmentCore& seg, SegmentId id,
                    absl::Span<const TransferRequest> requests, absl::Span<const LocalUse> local,
                    std::vector<Slice>* planned, SliceCheck* why) const;
  // The lone request `r` as one slice, when it is one (it fits a slice and
  // one local piece, and passes every check): true and the slice in `out`.
  // False, nothing else done, when the general path must decide (and say
  // what is wrong).
  bool PlanLone(const SegmentCore& seg, SegmentId id, const TransferRequest& r,
                const LocalUse& local, Slice* out) const;

 private:
  // The slice of request `i` (`r`) at `off`: as long as the slice size,
  // the local piece `use` (the next piece looked up when `off` is past it)
  // and the peer region (`reg`: the last one's, looked up again when `off`
  // is past it) allow, checked.
  absl::Status Cut(const SegmentCore& seg, SegmentId id, const TransferRequest& r, size_t i,
                   uint64_t off, LocalUse* use, const handshake::RegionDescriptor** reg, Slice* out,
                   SliceCheck* why) const;
  // Fills slice `out` of request `i` (`r`) at `off`: `len` bytes in local
  // piece `use` and peer region `reg`, both checked.
  void Fill(const SegmentCore& seg, SegmentId id, const TransferRequest& r, size_t i, uint64_t off,
            const LocalUse& use, const handshake::RegionDescriptor* reg, uint64_t len,
            Slice* out) const;
  // Appends request `r` (whose local piece is `local`) to `last`, a slice
  // of whole requests, when its bytes follow the slice's on both ends, in
  // the same local piece and peer region, and the slice stays within the
  // slice size; false (nothing changed) otherwise.
  bool Extend(const SegmentCore& seg, const TransferRequest& r, const LocalUse& local,
              Slice* last) const;

  const std::vector<Via>& vias_;
  const LocalRegions* const regions_;
  const uint32_t retries_;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_PLANNER_H_
