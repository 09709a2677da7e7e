#include "engine/pipeline/batch_table.h"

#include <utility>

namespace kvferry {
namespace engine_internal {

void Batch::Reset() {
  segment = 0;
  peer_engine_id = 0;
  epoch = 0;
  bound = false;
  announce = false;
  landed = 0;
  submitted = absl::Time();
  requests.clear();
  pending = 0;
}

void Batch::StatusTo(BatchStatus* out) const {
  out->pending = pending;
  out->succeeded = 0;
  out->failed = 0;
  out->requests.clear();
  out->requests.reserve(requests.size());
  for (const Request& r : requests) {
    if (r.slices_left > 0) {
      out->requests.push_back(absl::UnavailableError("pending"));
    } else {
      out->requests.push_back(r.status);
      ++(r.status.ok() ? out->succeeded : out->failed);
    }
  }
}

}  // namespace engine_internal
}  // namespace kvferry
