// The verbs transport's class, shared by its files: verbs_transport.cc
// (opening the NICs, registering memory), verbs_links.cc (links: creating,
// connecting, closing, routes), verbs_nic.cc (one NIC's parts: opening,
// registering on it, its CQ's entries, QP transitions, the link-parameter
// codec) and verbs_post.cc (posting work requests, completions, expiry). Internal to
// //transport/verbs:verbs_transport; users call CreateVerbsTransport.
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
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(VerbsTransportOptions options) : options_(std::move(options)) {}
  ~VerbsTransport() override;
  absl::Status Open();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    return Limits{options_.max_outstanding_per_link, max_request_bytes_, max_region_bytes_};
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
    MutexLock lock(&mu_);
    return links_.count(link) != 0;
  }
  absl::Status Post(absl::Span<const WorkRequest> batch) override;
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  void InterruptWait() override;
  bool SetCompletionNotifier(std::function<void()> notify) override {
    MutexLock lock(&mu_);
    const bool had = static_cast<bool>(notify_);
    notify_ = std::move(notify);
    // A caller that waits on its own event needs the poller to drain the
    // CQs: completion events stay requested for good (see sleepers_).
    if (!had && notify_) {
      ++sleepers_;
      for (Nic& nic : nics_) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
    } else if (had && !notify_) {
      --sleepers_;
    }
    return true;
  }

 private:
  struct RegionState {
    Region region;
    std::vector<ibv::Mr> mrs;  // per NIC
    uint64_t local_uses = 0;
  };
  // A work request on a QP, kept until its completion (or one after it)
  // comes.
  struct Posted {
    uint64_t wr_id = 0;
    WorkRequest wr;
    absl::Time posted;  // CoarseNow(), for expiry
    bool done = false;  // completed already (ExpireOld): skipped when it comes
  };
  struct Link {
    using State = LinkState;  // transport/checks.h
    LinkId id = 0;
    NicIndex nic = 0;
    ibv::Qp qp;
    uint32_t psn = 0;
    State state = State::kPending;
    size_t outstanding = 0;
    uint32_t max_inline = 0;  // what the QP accepts inline
    // Selective signaling: only the last work request of each chain is
    // signaled. Its completion means every earlier one on the QP completed
    // (RC completes in order), so the QP's work requests are kept in post
    // order: `posted` is a ring of them, oldest at `head` (their ids
    // increase along it).
    std::vector<Posted> posted;
    size_t head = 0;
    size_t count = 0;
    // The NIC's CQ entries this link holds (see Nic::cq_reserved).
    uint32_t* reserved_in = nullptr;
    uint32_t cq_entries = 0;
    Link() = default;
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;
    ~Link() {
      qp.reset();  // before giving its CQ entries back
      if (reserved_in != nullptr) *reserved_in -= cq_entries;
    }
    void Push(Posted p) { posted[(head + count++) % posted.size()] = std::move(p); }
    // The i-th oldest (i < count).
    Posted& At(size_t i) { return posted[(head + i) % posted.size()]; }
    Posted Pop() {
      Posted p = std::move(posted[head]);
      head = (head + 1) % posted.size();
      --count;
      return p;
    }
  };

  // A link on NIC `nic`: its QP in INIT, its CQ entries reserved.
  absl::StatusOr<Link*> NewLink(NicIndex nic) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the link's QP to RTR toward `peer`, then RTS: ready.
  absl::Status Connect(Link& link, const Params& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PollerLoop();
  // Delivers what NIC `nic`'s CQ holds; false if it held nothing.
  bool Drain(size_t nic);
  // Fails requests older than request_timeout (see the options).
  void ExpireOld();
  // Post's parts: the batch checked whole; one link's chain of work
  // requests (`chain`: indices of `batch`) built and accounted; a chain the
  // QP refused (from `bad` on) failed, and the QP put in error.
  // What a request names, found by ValidateLocked for ChainLocked.
  struct Resolved {
    Link* link = nullptr;
    RegionState* region = nullptr;
  };
  absl::Status ValidateLocked(absl::Span<const WorkRequest> batch, absl::Span<Resolved> found)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The work requests of `chain` (batch indices, one link's), linked.
  void ChainLocked(const Link& link, absl::Span<const WorkRequest> batch,
                   absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                   absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a posted chain: the link's ring and counters.
  void BooksLocked(Link& link, absl::Span<const WorkRequest> batch, absl::Span<const size_t> chain,
                   absl::Span<const Resolved> found, absl::Span<const ibv_send_wr> swrs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chains, posts (one doorbell) and records `chain`; a refused post fails
  // its requests (as completions) and the link (FailChainLocked).
  void PostChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                       absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                       absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                       absl::Span<const size_t> chain, absl::Span<ibv_send_wr> swrs,
                       const ibv_send_wr* bad, const absl::Status& posted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(const WorkRequest& wr, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One work completion of NIC `nic`'s CQ: it and the requests posted
  // before it on its QP.
  void DeliverLocked(size_t nic, const ibv_wc& wc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // by_qp_'s key for QP number `qpn` on NIC `nic` (QP numbers are per device).
  static uint64_t QpKey(size_t nic, uint32_t qpn) { return uint64_t{nic} << 32 | qpn; }
  const VerbsTransportOptions options_;
  std::vector<Nic> nics_;
  uint64_t max_request_bytes_ = 0;
  uint64_t max_region_bytes_ = uint64_t{1} << 40;  // and each NIC's max_mr_size
  std::thread poller_;
  std::atomic<bool> stopping_{false};
  // Threads asleep in WaitCompletions. Completion events are requested only
  // while some thread sleeps: a thread that polls the CQs itself needs no
  // wake-up, and the poller's wake-ups would only steal its CPU.
  std::atomic<int> sleepers_{0};
  // Set by InterruptWait: the next (or current) WaitCompletions returns.
  std::atomic<bool> interrupted_{false};

  Mutex mu_;
  CondVar cq_cv_;
  RegionId last_region_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<RegionId, std::unique_ptr<RegionState>> regions_ ABSL_GUARDED_BY(mu_);
  LinkId last_link_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<LinkId, std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
  uint64_t last_wr_ ABSL_GUARDED_BY(mu_) = 0;
  // Links by QpKey: a completion names its QP.
  absl::flat_hash_map<uint64_t, Link*> by_qp_ ABSL_GUARDED_BY(mu_);
  CompletionQueue cq_ ABSL_GUARDED_BY(mu_);
  std::function<void()> notify_ ABSL_GUARDED_BY(mu_);  // SetCompletionNotifier
  // RouteTo's answers by peer address (resolving can take a while).
  Mutex route_mu_;
  verbs::RouteCache routes_ ABSL_GUARDED_BY(route_mu_);
};

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_INTERNAL_H_
