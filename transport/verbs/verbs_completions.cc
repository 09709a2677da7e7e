// The verbs transport's CqPoller: the completion thread, draining the CQs
// and expiring requests that never complete.
#include <infiniband/verbs.h>
#include <poll.h>

#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/verbs_transport_internal.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

absl::Status CqPoller::Start() {
  ASSIGN_OR_RETURN(thread_, StartThread("the verbs completion poller", [this] { Loop(); }));
  return absl::OkStatus();
}

void CqPoller::Stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
}

bool CqPoller::Drain(size_t nic) {
  ibv_wc wc[32];
  bool any = false;
  for (;;) {
    // Polled under the lock: ReserveCq may resize the CQ.
    MutexLock lock(&core_.mu);
    absl::StatusOr<int> polled = ibv::PollCq(core_.nics[nic].cq.get(), 32, wc);
    if (!polled.ok()) {
      KVF_LOG(WARNING) << "verbs: " << polled.status();
      return any;
    }
    const int n = *polled;
    if (n == 0) return any;
    any = true;
    for (int i = 0; i < n; ++i) DeliverLocked(nic, wc[i]);
  }
}

void CqPoller::DeliverLocked(size_t nic, const ibv_wc& wc) {
  auto link = core_.by_qp.find(QpKey(nic, wc.qp_num));
  if (link == core_.by_qp.end()) return;  // closed: its requests were cancelled
  VerbsLink& l = *link->second;
  // Not among the QP's requests (ids increase along the ring): a late one
  // of a closed QP whose number the NIC gave again.
  if (l.count == 0 || wc.wr_id < l.At(0).wr_id || wc.wr_id > l.At(l.count - 1).wr_id) return;
  // The work requests posted before this one on the QP are complete: RC
  // completes in order, and they were unsignaled (or their own completion
  // came already). An error completion also vouches for them: they
  // finished before the one that failed.
  while (l.count > 0) {
    const Posted p = l.Pop();
    const uint64_t id = p.wr_id;
    if (p.done) {  // expired meanwhile
      if (id == wc.wr_id) return;
      continue;
    }
    const WorkRequest& wr = p.wr;
    --l.outstanding;
    if (id == wc.wr_id) {
      absl::Status status;
      if (wc.status != IBV_WC_SUCCESS) {
        status = absl::Status(CodeOf(wc.status), absl::StrFormat("%s (QP %#x, vendor error %#x)",
                                                                 ibv::WcStatusStr(wc.status),
                                                                 wc.qp_num, wc.vendor_err));
        l.state = VerbsLink::State::kError;
      }
      core_.CompleteLocked(wr, std::move(status));
      return;
    }
    core_.CompleteLocked(wr, absl::OkStatus());
  }
}

void CqPoller::ExpireOld() {
  const absl::Time now = CoarseNow();  // as Post stamps requests
  MutexLock lock(&core_.mu);
  for (auto& [id, link] : core_.links) {
    VerbsLink& l = *link;
    for (size_t i = 0; i < l.count; ++i) {
      Posted& p = l.At(i);
      if (p.done || now - p.posted < core_.options.request_timeout) continue;
      if (l.state == VerbsLink::State::kError) {
        // The QP is in the error state and touches no buffer; its flush
        // completion should have come. A NIC that never sends it (seen with
        // Soft-RoCE while it retransmits to a peer that drops everything)
        // must not hold the request forever.
        if (now - p.posted >= 2 * core_.options.request_timeout) {
          --l.outstanding;
          p.done = true;
          core_.CompleteLocked(
              p.wr, absl::AbortedError(absl::StrFormat(
                        "QP %#x is in the error state and its flush never came", l.qp->qp_num)));
        }
        continue;
      }
      l.state = VerbsLink::State::kError;
      // In the error state the NIC touches no buffer of this QP any more; the
      // other requests come back as flush errors (kAborted).
      if (absl::Status reset = ibv::ResetToError(l.qp.get()); !reset.ok()) {
        KVF_LOG(WARNING) << "verbs: " << reset;
      }
      --l.outstanding;
      p.done = true;
      core_.CompleteLocked(
          p.wr, absl::UnavailableError(absl::StrFormat(
                    "no completion from the peer within %s on QP %#x: peer presumed gone",
                    absl::FormatDuration(core_.options.request_timeout), l.qp->qp_num)));
    }
  }
}

void CqPoller::Loop() {
  // Sleeps in the kernel until a CQ has news (or 100 ms pass, to check for
  // expired requests and shutdown), re-arms, then drains.
  std::vector<pollfd> fds;
  for (Nic& nic : core_.nics) fds.push_back(pollfd{nic.channel->fd, POLLIN, 0});
  absl::Time next_expiry_check = absl::Now();
  while (!stopping_) {
    if (absl::Now() >= next_expiry_check) {
      ExpireOld();
      next_expiry_check = absl::Now() + absl::Milliseconds(100);
    }
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (size_t i = 0; i < core_.nics.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      absl::StatusOr<ibv_cq*> event = ibv::GetCqEvent(core_.nics[i].channel.get());
      if (!event.ok()) continue;  // poll() said readable; a failed read is skipped
      ibv_cq* cq = *event;
      // Re-arm first, so nothing is missed, but only for sleepers (see
      // core_.sleepers); a thread that goes to sleep later arms for itself.
      if (core_.sleepers.load() > 0) (void)ibv::ReqNotifyCq(cq, core_.nics[i].port.device);
      Drain(i);
    }
  }
}

}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
