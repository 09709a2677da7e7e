// The engine's transports as the pipeline uses them ("vias"): each with the
// slice size, link count and link capacity it gets, fixed at creation.
#ifndef KVFERRY_ENGINE_PIPELINE_VIAS_H_
#define KVFERRY_ENGINE_PIPELINE_VIAS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/metrics/metrics.h"
#include "engine/types.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// The slice size over a transport that states no preference.
constexpr uint64_t kDefaultSliceBytes = 64 << 10;
// Links per peer over a transport that states no preference.
constexpr uint32_t kDefaultLinks = 2;

struct PipelineConfig {
  uint64_t slice_bytes = 0;  // 0: each transport's preferred request size
  uint32_t retries = 2;
  uint32_t links_per_peer = 0;  // 0: each transport's preferred link count
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration idle_segment_timeout = absl::Minutes(10);
};

// A transport of this engine.
struct Via {
  transport::Transport* transport = nullptr;
  std::string kind;
  uint32_t link_capacity = 1;
  uint64_t slice_bytes = 0;  // the largest slice it gets
  uint32_t links = 0;        // links it opens per peer (at least one per NIC)
  size_t nic_offset = 0;     // its NICs' first index in the engine's NIC counters
};

// `transports` (the primary first) as vias under `config`.
std::vector<Via> MakeVias(const std::vector<transport::Transport*>& transports,
                          const PipelineConfig& config);
// Zeroed counters for every NIC of `vias`, in order (each via's nic_offset
// indexes its first).
std::vector<NicCounters> NicsOf(const std::vector<Via>& vias);

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_VIAS_H_
