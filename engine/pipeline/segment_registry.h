// The segment registry: the pipeline's peers. Opens a segment (finding its
// path as path_choice.h says: describing the peer and connecting links are
// the only I/O), refreshes it (handshakes again and rebuilds the links),
// closes it, and closes the links of one idle for idle_segment_timeout.
//
// Owns the books lock (kBooksLock): the segment table, links' state and the
// engine's counters are guarded by it, and the pipeline's other units take
// it (books()) before a lane's lock when they touch both. It is held only
// for bookkeeping, never across a handshake or a transport wait.
#ifndef KVFERRY_ENGINE_PIPELINE_SEGMENT_REGISTRY_H_
#define KVFERRY_ENGINE_PIPELINE_SEGMENT_REGISTRY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "engine/peer/peer_client.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/path_choice.h"
#include "engine/pipeline/segment_table.h"
#include "engine/pipeline/vias.h"
#include "engine/types.h"

namespace kvferry {
namespace engine_internal {

class SegmentRegistry {
 public:
  // Every pointer outlives the registry. `nics`: the engine's NIC counters
  // as MakeVias built them (errors and retries count here).
  SegmentRegistry(const PipelineConfig& config, uint64_t engine_id, const std::vector<Via>* vias,
                  std::vector<NicCounters> nics, const PeerClient* client, Clock* clock,
                  HostFacts facts, Lanes* lanes);

  // `peer` in canonical "host:port" form. The choice of transport and its
  // reason are logged and kept in the peer's metrics.
  absl::StatusOr<SegmentId> Open(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Close(SegmentId id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<RemoteRegion>> Regions(SegmentId id) const ABSL_LOCKS_EXCLUDED(mu_);
  // The peer's address, its instance and the links' generation.
  struct PeerView {
    std::string peer;
    uint64_t engine_id = 0;
    uint64_t generation = 0;
    uint64_t epoch = 0;  // SegmentCore::epoch
  };
  // The peer at `peer` fenced this engine, which goes at `epoch` with it
  // now: its segment, if ready at an earlier epoch, is refreshed before
  // its next slice (the peer closed its links).
  void FencedBy(const std::string& peer, uint64_t epoch) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PeerView> View(SegmentId id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Re-reads the peer's descriptor and rebuilds the links. One refresh per
  // segment at a time; callers that arrive meanwhile wait for it, and there
  // is nothing to do when the links the caller found broken
  // (`seen_generation`, UINT64_MAX: the current ones) were replaced since.
  // Sets *changed when the peer's engine id changed.
  absl::Status Refresh(SegmentId id, bool* changed, uint64_t seen_generation = UINT64_MAX)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the segment's current view into `lane`: OK, or why the segment
  // cannot take slices now (kFailedPrecondition: not ready, refresh it).
  absl::Status ReadView(Lane& lane, SegmentId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks the peer of `segment` to close its halves of `links` (ids and the
  // names the peer gave them) and marks them closed; an error when the
  // peer could not be asked or answered one.
  absl::Status ClosePeerHalves(SegmentId segment,
                               const std::vector<std::pair<transport::LinkId, std::string>>& links)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Closes the links of segments idle for idle_segment_timeout (their ids
  // stay valid: the next Submit handshakes again).
  void ExpireIdle(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseLinks(size_t via, const std::vector<Link>& links) const;

  // The books: what the lock guards.
  Mutex& books() const ABSL_LOCK_RETURNED(mu_) { return mu_; }
  SegmentTable& table() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return table_; }
  EngineCounters& counters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return counters_; }
  std::vector<NicCounters>& nic_counters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return nic_counters_;
  }

  // Metrics: every peer (with what the lanes counted), the NICs, the engine.
  std::vector<PeerMetrics> Peers() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<NicCounters> NicCountersNow() const ABSL_LOCKS_EXCLUDED(mu_);
  EngineCounters Counters() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Which transport a peer goes over, its descriptor for it, the links.
  struct Path {
    size_t via = 0;
    handshake::EngineDescriptor descriptor;
    std::vector<Link> links;
    std::string why;
    uint64_t epoch() const;  // the links' (the latest of them)
  };
  // Runs the steps ChoosePath gives until one succeeds or it says no; once
  // more if the peer's refusal taught this engine a new epoch with it (it
  // had fenced this engine: PeerClient::EpochWith).
  absl::StatusOr<Path> FindPath(const std::string& peer) const;
  absl::StatusOr<Path> FindPathOnce(const std::string& peer) const;
  // Links offered with the request for the peer's descriptor of transport
  // `via`'s kind: one round trip for both (DescribeWithLinks). Nullopt when
  // the usual choice must be made.
  absl::StatusOr<std::optional<Path>> OneRoundTrip(const std::string& peer, size_t via) const;
  absl::StatusOr<Path> Connect(const std::string& peer, size_t via,
                               handshake::EngineDescriptor d) const;

  const PipelineConfig config_;
  const uint64_t engine_id_;
  const std::vector<Via>& vias_;
  std::vector<std::string> kinds_;  // vias_' kinds, in order
  const PeerClient* const client_;
  Clock* const clock_;
  const HostFacts facts_;
  Lanes* const lanes_;

  mutable Mutex mu_{kBooksLock};
  CondVar refreshed_;  // a refresh finished
  SegmentTable table_ ABSL_GUARDED_BY(mu_);
  // Errors and retries by NIC (slices and bytes count in the lanes).
  std::vector<NicCounters> nic_counters_ ABSL_GUARDED_BY(mu_);
  EngineCounters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_SEGMENT_REGISTRY_H_
