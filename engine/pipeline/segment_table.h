// Peers this engine talks to: one segment per peer "host:port", holding the
// peer instance's descriptor (regions, NICs), the links to it and the slices
// waiting for room on them. A plain container: the books lock guards it
// (segment_registry.h). What submitting threads need of a ready
// segment they read from a published view, without that lock (lanes.h).
#ifndef KVFERRY_ENGINE_PIPELINE_SEGMENT_TABLE_H_
#define KVFERRY_ENGINE_PIPELINE_SEGMENT_TABLE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/metrics/metrics.h"
#include "engine/pipeline/link_set.h"
#include "engine/types.h"
#include "handshake/messages.h"
#include "transport/checks.h"

namespace kvferry {
namespace engine_internal {

enum class SegmentState {
  kReady,       // descriptor and links usable
  kStale,       // must be refreshed (handshake again) before new slices
  kRefreshing,  // one thread is refreshing; others wait for it
};

// What planning and posting a slice read of a segment: the segment's own,
// and (copied) each published view of it.
struct SegmentCore {
  std::string peer;
  handshake::EngineDescriptor descriptor;  // regions sorted by address
  std::vector<Link> links;
  size_t via = 0;           // the engine's transport it goes over (vias.h)
  uint64_t generation = 0;  // bumped by every refresh
  // This engine's epoch with the peer when the links were made (theirs,
  // Link::epoch). After the peer fenced this engine, the links of the
  // next refresh are of a later epoch, and slices of batches from before
  // it fail instead of going on them (Poster).
  uint64_t epoch = 0;

  // The peer region containing `addr`, if any.
  const handshake::RegionDescriptor* FindRemote(uint64_t addr) const;
};

// A segment's published view: `view` (null unless the segment is ready) is
// replaced under the pipeline's lock, and `version` bumped with it; a
// thread holding a copy of the view knows it is current while the version
// it read with it still holds. The view itself never changes (its links'
// loads are atomic).
struct SegmentShared {
  std::atomic<uint64_t> version{0};
  // Lanes that have used the segment: each lane's first link (its "home",
  // see LaneSegment) is the next one, so that threads keep to different
  // links.
  std::atomic<uint32_t> lanes{0};
  std::shared_ptr<const SegmentCore> view;  // guarded by the pipeline's lock
};

struct Segment : SegmentCore {
  SegmentState state = SegmentState::kReady;
  bool probing = false;  // a liveness probe is out
  // Set when the peer did not answer a probe: slices of this generation
  // fail with it instead of being retried.
  absl::Status dead;
  // Slices waiting for room on a link, in submission order.
  std::deque<uint64_t> backlog;
  // Last opened (slices count in the lanes, see lanes.h).
  absl::Time last_used;
  // The peer's transport, retries and reconnects; what each slice and
  // request adds is counted in the lanes.
  PeerMetrics metrics;
  std::shared_ptr<SegmentShared> shared = std::make_shared<SegmentShared>();

  // Publishes the segment as it is now (a view when ready, none else).
  void Publish();
};

// Why a slice cannot go to a segment.
enum class SliceCheck { kOk, kOutsideRegions, kForbidden, kNoLinks };

// Checks [remote, +length) against the segment's advertised regions for
// `write` (or read); `error` gets the message when not kOk, `region` (if
// given) the peer region containing `remote`.
SliceCheck CheckRemote(const SegmentCore& seg, uint64_t remote, uint64_t length, bool write,
                       absl::Status* error, const handshake::RegionDescriptor** region = nullptr);
// Whether CheckRegion says kOk, without the message (a lone request's short
// path: the general one explains a refusal).
inline bool RegionAllows(const SegmentCore& seg, const handshake::RegionDescriptor* found,
                         uint64_t remote, uint64_t length, bool write) {
  return found != nullptr && transport::RangeInside(remote, length, found->addr, found->length) &&
         (write ? transport::AllowsRemoteWrite(found->access)
                : transport::AllowsRemoteRead(found->access)) &&
         !seg.links.empty();
}
// The same with the region containing `remote` already looked up (`found`,
// null when none).
SliceCheck CheckRegion(const SegmentCore& seg, const handshake::RegionDescriptor* found,
                       uint64_t remote, uint64_t length, bool write, absl::Status* error,
                       const handshake::RegionDescriptor** region = nullptr);

class SegmentTable {
 public:
  Segment* Find(SegmentId id);
  const Segment* Find(SegmentId id) const;
  // The segment of `peer` ("host:port" as ParseHostPort prints it), or 0.
  SegmentId ByPeer(const std::string& peer) const;
  SegmentId Add(Segment segment);
  void Remove(SegmentId id);
  template <typename F>
  void ForEach(F f) {
    for (auto& [id, seg] : segments_) f(id, seg);
  }

 private:
  absl::flat_hash_map<std::string, SegmentId> by_peer_;
  // Node-based: a Segment stays where it is until removed.
  absl::node_hash_map<SegmentId, Segment> segments_;
  SegmentId last_ = 0;
  // The last segment found: completions and slices come in runs of one peer.
  SegmentId last_found_id_ = 0;
  Segment* last_found_ = nullptr;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_SEGMENT_TABLE_H_
