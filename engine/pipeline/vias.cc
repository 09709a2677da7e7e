#include "engine/pipeline/vias.h"

#include <algorithm>
#include <utility>

namespace kvferry {
namespace engine_internal {

std::vector<Via> MakeVias(const std::vector<transport::Transport*>& transports,
                          const PipelineConfig& config) {
  std::vector<Via> vias;
  size_t nics = 0;
  for (transport::Transport* t : transports) {
    const transport::EndpointDescription endpoint = t->LocalEndpoint();
    Via v;
    v.transport = t;
    v.kind = endpoint.kind;
    const transport::Limits limits = t->GetLimits();
    v.link_capacity = std::max<uint32_t>(1, limits.max_outstanding_per_link);
    v.slice_bytes = config.slice_bytes != 0               ? config.slice_bytes
                    : limits.preferred_request_bytes != 0 ? limits.preferred_request_bytes
                                                          : kDefaultSliceBytes;
    if (limits.max_request_bytes != 0) {
      v.slice_bytes = std::min(v.slice_bytes, limits.max_request_bytes);
    }
    v.links = config.links_per_peer != 0    ? config.links_per_peer
              : limits.preferred_links != 0 ? limits.preferred_links
                                            : kDefaultLinks;
    v.nic_offset = nics;
    nics += endpoint.nics.size();
    vias.push_back(std::move(v));
  }
  return vias;
}

std::vector<NicCounters> NicsOf(const std::vector<Via>& vias) {
  std::vector<NicCounters> out;
  for (const Via& v : vias) {
    for (const transport::NicInfo& nic : v.transport->LocalEndpoint().nics) {
      out.push_back(NicCounters{nic.name, 0, 0});
    }
  }
  return out;
}

}  // namespace engine_internal
}  // namespace kvferry
