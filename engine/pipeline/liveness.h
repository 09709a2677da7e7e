// Liveness: finding peers that stopped answering while requests to them are
// in flight (EngineOptions::peer_timeout), and rebuilding failed links.
// Given the registry: it probes peers whose busy links have been silent
// for peer_timeout / 2, fails (or moves to a restarted peer) what was
// posted to one that does not answer, and tries a failed link's NIC pair
// again once its slices have moved off it. Its state is the segments'
// (under the books lock) and when it looks next.
#ifndef KVFERRY_ENGINE_PIPELINE_LIVENESS_H_
#define KVFERRY_ENGINE_PIPELINE_LIVENESS_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/clock.h"
#include "engine/peer/peer_client.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/segment_registry.h"
#include "engine/pipeline/vias.h"

namespace kvferry {
namespace engine_internal {

class Liveness {
 public:
  // Every pointer outlives it.
  Liveness(const PipelineConfig& config, uint64_t engine_id, const std::vector<Via>* vias,
           SegmentRegistry* segments, Lanes* lanes, const PeerClient* client, Clock* clock);
  // Looks at most every peer_timeout / 4 (cheap otherwise): expires idle
  // segments, probes silent peers, repairs failed links. Blocks for the
  // probes (peer_timeout / 2 at most each) and repairs it runs.
  void Check(absl::Time now) ABSL_LOCKS_EXCLUDED(segments_->books());

 private:
  // A failed link whose NIC pair is tried again.
  struct Repair {
    SegmentId segment = 0;
    uint64_t generation = 0;
    size_t via = 0;
    std::string peer;
    Link old;
    transport::NicInfo peer_nic;
    std::optional<uint64_t> capabilities;  // the peer's (its descriptor's)
  };
  void FindRepairs(absl::Time now, std::vector<Repair>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_->books());
  void RepairLink(const Repair& r);
  void ProbeResult(SegmentId id, const std::string& peer, const absl::StatusOr<uint64_t>& answer);

  const PipelineConfig config_;
  const uint64_t engine_id_;
  const std::vector<Via>& vias_;
  SegmentRegistry* const segments_;
  Lanes* const lanes_;
  const PeerClient* const client_;
  Clock* const clock_;
  // When Check looks next, Unix nanoseconds; read without the lock.
  std::atomic<int64_t> next_check_ns_{0};
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_LIVENESS_H_
