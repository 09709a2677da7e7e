// The state the verbs transport's units share: its NICs, regions, links
// and completions, under one lock (VerbsCore::mu). The units:
//   VerbsTransport  the Transport: NICs opened, memory, links, polling
//                   (verbs_transport.cc, verbs_links.cc);
//   ChainPoster     Post: one chain of work requests per link, one doorbell
//                   (verbs_post.cc);
//   CqPoller        the completion thread: the CQs drained, requests that
//                   never complete expired (verbs_completions.cc).
// Internal to //transport/verbs:verbs_transport.
#ifndef KVFERRY_TRANSPORT_VERBS_VERBS_STATE_H_
#define KVFERRY_TRANSPORT_VERBS_VERBS_STATE_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/transport.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/verbs_nic.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

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
struct VerbsLink {
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
  VerbsLink() = default;
  VerbsLink(const VerbsLink&) = delete;
  VerbsLink& operator=(const VerbsLink&) = delete;
  ~VerbsLink() {
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

// by_qp's key for QP number `qpn` on NIC `nic` (QP numbers are per device).
inline uint64_t QpKey(size_t nic, uint32_t qpn) { return uint64_t{nic} << 32 | qpn; }

struct VerbsCore {
  explicit VerbsCore(VerbsTransportOptions opts) : options(std::move(opts)) {}

  // Queues a completion and wakes its waiters.
  void CompleteLocked(const WorkRequest& wr, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cq.Push(wr, std::move(status));
    cq_cv.SignalAll();
    if (notify) notify();
  }

  const VerbsTransportOptions options;
  std::vector<Nic> nics;  // set by Open, then fixed
  uint64_t max_request_bytes = 0;
  uint64_t max_region_bytes = uint64_t{1} << 40;  // and each NIC's max_mr_size
  // Threads asleep in WaitCompletions. Completion events are requested only
  // while some thread sleeps: a thread that polls the CQs itself needs no
  // wake-up, and the poller's wake-ups would only steal its CPU.
  std::atomic<int> sleepers{0};
  // Set by InterruptWait: the next (or current) WaitCompletions returns.
  std::atomic<bool> interrupted{false};

  Mutex mu;
  CondVar cq_cv;
  absl::flat_hash_map<RegionId, std::unique_ptr<RegionState>> regions ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<LinkId, std::unique_ptr<VerbsLink>> links ABSL_GUARDED_BY(mu);
  // Links by QpKey: a completion names its QP.
  absl::flat_hash_map<uint64_t, VerbsLink*> by_qp ABSL_GUARDED_BY(mu);
  CompletionQueue cq ABSL_GUARDED_BY(mu);
  std::function<void()> notify ABSL_GUARDED_BY(mu);  // SetCompletionNotifier
};

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_VERBS_STATE_H_
