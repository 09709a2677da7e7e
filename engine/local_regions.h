// The engine's registered memory: which local ranges requests may use, their
// transport regions, and which local NICs are near each of them. Owns its
// state and its lock; the transport registers outside the lock.
#ifndef KVFERRY_ENGINE_LOCAL_REGIONS_H_
#define KVFERRY_ENGINE_LOCAL_REGIONS_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "handshake/messages.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// A set of local NICs, bit i for NIC i; 0 means "no preference" (NICs past
// the 64th are never preferred).
using NicMask = uint64_t;

// A local buffer as a request uses it.
struct LocalUse {
  transport::RegionId region = 0;
  NicMask near = 0;
};

class LocalRegions {
 public:
  explicit LocalRegions(transport::Transport* transport) : transport_(transport) {}

  // Registers [addr, +length) with the transport. kInvalidArgument for a
  // null or empty range or one that overlaps a region (even one still being
  // registered by another thread).
  absl::Status Register(void* addr, uint64_t length, transport::Access access, NicMask near);
  // kNotFound when no region starts at `addr`; the transport's error (e.g.
  // kFailedPrecondition while requests use it) leaves it registered.
  absl::Status Unregister(void* addr);
  // The region holding [addr, +length), or kInvalidArgument.
  absl::StatusOr<LocalUse> Find(const void* addr, uint64_t length) const;
  // The regions peers may use, for the descriptor.
  std::vector<handshake::RegionDescriptor> Advertised() const;

 private:
  struct Entry {
    transport::Region region;  // id 0 while the transport registers it
    NicMask near = 0;
  };
  transport::Transport* const transport_;
  mutable Mutex mu_;
  std::map<uint64_t, Entry> by_addr_ ABSL_GUARDED_BY(mu_);
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_LOCAL_REGIONS_H_
