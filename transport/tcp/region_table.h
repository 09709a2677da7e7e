// The TCP transport's registered memory: its regions by id and by key, under
// a lock of its own, and the peers' use of them. A peer's request marks the
// region in use while its bytes cross the network (no lock is held across
// that I/O); a region being removed is revoked first, then drained of such
// uses (a stalled peer's connections are shut down after a grace period, so
// the caller is never blocked for long). The requester side counts its own
// outstanding requests per region, and a region they use is not removed.
//
// Thread-safe. Internal to transport/tcp.
#ifndef KVFERRY_TRANSPORT_TCP_REGION_TABLE_H_
#define KVFERRY_TRANSPORT_TCP_REGION_TABLE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "transport/host_share.h"
#include "transport/tcp/wire.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

class RegionTable {
 public:
  struct Entry : std::enable_shared_from_this<Entry> {
    Region region;
    // This transport's outstanding requests whose local buffer lies in it.
    std::atomic<uint64_t> local_uses{0};
    // Connections moving a peer's request's bytes into or out of it now,
    // and whether it was removed: Remove waits for them.
    Mutex use_mu;
    CondVar use_cv;
    // Set (under use_mu) once the region is removed; read under use_mu
    // by UseRemote, and without it by a Held use.
    std::atomic<bool> revoked{false};
    std::vector<int> using_fds ABSL_GUARDED_BY(use_mu);
    int device = -1;  // the CUDA device it lies on; -1: host memory
    // What lets peers on this host copy it themselves; null: nothing.
    std::unique_ptr<HostShare::Export> share;
  };
  // One connection's use of a region for a peer's request; ends when
  // destroyed.
  class Use {
   public:
    Use() = default;
    Use(std::shared_ptr<Entry> entry, int fd) : entry_(std::move(entry)), fd_(fd) {}
    Use(Use&& o) noexcept : entry_(std::move(o.entry_)), fd_(o.fd_) {}
    Use& operator=(Use&&) = delete;
    ~Use();

    Entry* entry() const { return entry_.get(); }

   private:
    std::shared_ptr<Entry> entry_;
    int fd_ = -1;
  };
  // A connection reader's Use kept from one request of its peer to the
  // next while they name the same region: a stream of requests into one
  // region then takes no lock, no lookup and no atomic count each. The
  // reader releases it before it could block for the peer's next request
  // (an idle link never holds up Remove), and a held use of a removed
  // region is dropped at the next request, which is checked afresh.
  class Held {
   public:
    void Release() { use_.reset(); }
    bool holding() const { return use_.has_value(); }

   private:
    friend class RegionTable;
    std::optional<Use> use_;
  };

  // Adds [base, +length) with a fresh random key; returns its Region.
  Region Add(uint64_t base, uint64_t length, Access access, int device,
             std::unique_ptr<HostShare::Export> share) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes region `id`, then withdraws its share and waits for the peers'
  // uses of it (RevokeAndDrain). kNotFound for an unknown id;
  // kFailedPrecondition while this transport's requests use it.
  absl::Status Remove(RegionId id) ABSL_LOCKS_EXCLUDED(mu_);

  // The lock a caller holds (shared) across Find and CheckRemote.
  SharedMutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }
  // Region `id`, or null.
  Entry* Find(RegionId id) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second.get();
  }
  // The CUDA device region `id` lies on; -1: host memory, or no such region.
  int DeviceOf(RegionId id) ABSL_LOCKS_EXCLUDED(mu_);
  // A peer's request `h`: its key, range and access checked; *target is
  // where its bytes lie here, *device (if not null) their CUDA device.
  absl::Status CheckRemote(const tcp_wire::DataHeader& h, bool write, char** target,
                           int* device = nullptr) ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // CheckRemote, and marks connection `fd` as using the region until the
  // returned Use ends; refused once the region is removed.
  absl::StatusOr<Use> UseRemote(const tcp_wire::DataHeader& h, bool write, int fd, char** target,
                                int* device) ABSL_LOCKS_EXCLUDED(mu_);
  // UseRemote through `held`: the region it holds serves a request naming
  // its key without a lookup while not removed; otherwise `held` is
  // released and holds what UseRemote returns.
  absl::Status UseRemoteHeld(const tcp_wire::DataHeader& h, bool write, int fd, Held* held,
                             char** target, int* device) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // After a region left the tables: waits for the peers' requests moving
  // its bytes; past a grace period it shuts their connections down.
  static void RevokeAndDrain(Entry& entry);

  SharedMutex mu_;
  RegionId last_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<RegionId, std::shared_ptr<Entry>> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RemoteKey, Entry*> by_key_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_REGION_TABLE_H_
