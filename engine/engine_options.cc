#include "engine/engine_options.h"

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace engine_internal {

absl::Status CheckOptions(const EngineOptions& o) {
  if (o.peer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer_timeout must be positive");
  }
  if (o.idle_segment_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("idle_segment_timeout must be positive");
  }
  if (o.links_per_peer > 64) {
    return absl::InvalidArgumentError("links_per_peer must be 1 to 64 (0: the transport's choice)");
  }
  if (o.port == 0 && (o.first_port == 0 || o.last_port < o.first_port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port range ", o.first_port, "-", o.last_port));
  }
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace kvferry
