// The verbs transport's units (their shared state: verbs_state.h), in
// their files: verbs_transport.cc (VerbsTransport: opening the NICs,
// registering memory, polling), verbs_links.cc (VerbsTransport: links
// created, connected and closed, routes), verbs_post.cc (ChainPoster),
// verbs_completions.cc (CqPoller), and verbs_nic.cc (one NIC's parts as
// functions: opening, registering on it, its CQ's entries, QP transitions,
// the link-parameter codec). Internal to //transport/verbs:verbs_transport;
// users call CreateVerbsTransport.
#ifndef KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_INTERNAL_H_
#define KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_INTERNAL_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "cuda/driver.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/transport.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/route.h"
#include "transport/verbs/verbs_nic.h"
#include "transport/verbs/verbs_state.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

// Post: the batch checked whole, then per link one chain of work requests
// (one doorbell), selectively signaled, recorded in the link's ring.
class ChainPoster {
 public:
  explicit ChainPoster(VerbsCore& core) : core_(core) {}

  absl::Status Post(absl::Span<const WorkRequest> batch) ABSL_LOCKS_EXCLUDED(core_.mu);

 private:
  // What a request names, found by ValidateLocked for ChainLocked.
  struct Resolved {
    VerbsLink* link = nullptr;
    RegionState* region = nullptr;
  };
  absl::Status ValidateLocked(absl::Span<const WorkRequest> batch, absl::Span<Resolved> found)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // The work requests of `chain` (batch indices, one link's), linked.
  void ChainLocked(const VerbsLink& link, absl::Span<const WorkRequest> batch,
                   absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                   absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // Records a posted chain: the link's ring and counters.
  void BooksLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
                   absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                   absl::Span<const ibv_send_wr> swrs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // Chains, posts (one doorbell) and records `chain`; a refused post fails
  // its requests (as completions) and the link (FailChainLocked).
  void PostChainLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
                       absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                       absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // A chain the QP refused (from `bad` on) failed, and the QP put in error.
  void FailChainLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
                       absl::Span<const size_t> chain, absl::Span<ibv_send_wr> swrs,
                       const ibv_send_wr* bad, const absl::Status& posted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);

  VerbsCore& core_;
  uint64_t last_wr_ ABSL_GUARDED_BY(core_.mu) = 0;
};

// The completion thread: sleeps until a CQ has news, drains it (a
// completion vouches for the unsignaled requests before it on its QP), and
// fails requests that never complete.
class CqPoller {
 public:
  explicit CqPoller(VerbsCore& core) : core_(core) {}
  ~CqPoller() { Stop(); }

  absl::Status Start();
  void Stop();
  // Delivers what NIC `nic`'s CQ holds; false if it held nothing. Any
  // thread may call it (WaitCompletions polls the CQs itself for a while).
  bool Drain(size_t nic) ABSL_LOCKS_EXCLUDED(core_.mu);

 private:
  void Loop();
  // One work completion of NIC `nic`'s CQ: it and the requests posted
  // before it on its QP.
  void DeliverLocked(size_t nic, const ibv_wc& wc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // Fails requests older than request_timeout (see the options).
  void ExpireOld() ABSL_LOCKS_EXCLUDED(core_.mu);

  VerbsCore& core_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(VerbsTransportOptions options) : core_(std::move(options)) {}
  ~VerbsTransport() override;
  absl::Status Open();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    return Limits{core_.options.max_outstanding_per_link, core_.max_request_bytes,
                  core_.max_region_bytes};
  }
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) override;
  absl::Status UnregisterMemory(RegionId region) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::StatusOr<NicIndex> RouteTo(const NicInfo& peer_nic) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override {
    MutexLock lock(&core_.mu);
    return core_.links.count(link) != 0;
  }
  absl::Status Post(absl::Span<const WorkRequest> batch) override { return poster_.Post(batch); }
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  void InterruptWait() override;
  bool SetCompletionNotifier(std::function<void()> notify) override {
    MutexLock lock(&core_.mu);
    const bool had = static_cast<bool>(core_.notify);
    core_.notify = std::move(notify);
    // A caller that waits on its own event needs the poller to drain the
    // CQs: completion events stay requested for good (see sleepers).
    if (!had && core_.notify) {
      ++core_.sleepers;
      for (Nic& nic : core_.nics) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
    } else if (had && !core_.notify) {
      --core_.sleepers;
    }
    return true;
  }

 private:
  using Link = VerbsLink;
  // A link on NIC `nic`: its QP in INIT, its CQ entries reserved.
  absl::StatusOr<Link*> NewLink(NicIndex nic) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // Moves the link's QP to RTR toward `peer`, then RTS: ready.
  absl::Status Connect(Link& link, const Params& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);

  VerbsCore core_;
  ChainPoster poster_{core_};
  CqPoller poller_{core_};
  RegionId last_region_ ABSL_GUARDED_BY(core_.mu) = 0;
  LinkId last_link_ ABSL_GUARDED_BY(core_.mu) = 0;
  // RouteTo's answers by peer address (resolving can take a while).
  Mutex route_mu_;
  verbs::RouteCache routes_ ABSL_GUARDED_BY(route_mu_);
};

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_INTERNAL_H_
