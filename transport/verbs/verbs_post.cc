// The verbs transport's data path: posting work requests (chains, one
// doorbell per link, selective signaling), completions, and expiry of
// requests that never complete.
#include "transport/verbs/verbs_transport_internal.h"

#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "transport/checks.h"
#include "transport/verbs/ibv.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

absl::Status VerbsTransport::ValidateLocked(absl::Span<const WorkRequest> batch,
                                           absl::Span<Resolved> found) {
  for (size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& wr = batch[i];
    auto link = links_.find(wr.link);
    RETURN_IF_ERROR(CheckLinkUsable(wr.link, link == links_.end() ? nullptr : &link->second->state));
    auto region = regions_.find(wr.local_region);
    if (region == regions_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
    }
    RETURN_IF_ERROR(CheckLocal(wr, region->second->region, max_request_bytes_));
    if (wr.remote_key > UINT32_MAX) {
      return absl::InvalidArgumentError(absl::StrFormat("remote key %#x is not a verbs rkey",
                                                        wr.remote_key));
    }
    found[i] = Resolved{link->second.get(), region->second.get()};
  }
  return CheckLinkCapacity(
      batch,
      [&](LinkId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        for (const Resolved& r : found) {
          if (r.link->id == id) return r.link->outstanding;
        }
        return size_t{0};  // not reached: every link of the batch was found above
      },
      options_.max_outstanding_per_link);
}

void VerbsTransport::ChainLocked(const Link& link, absl::Span<const WorkRequest> batch,
                                 absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                                 absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges) {
  for (size_t n = 0; n < chain.size(); ++n) {
    const size_t i = chain[n];
    const WorkRequest& wr = batch[i];
    const RegionState& region = *found[i].region;
    ibv_sge& sge = sges[i];
    sge = ibv_sge{};
    sge.addr = reinterpret_cast<uintptr_t>(wr.local_addr);
    sge.length = static_cast<uint32_t>(wr.length);
    sge.lkey = region.mrs[link.nic]->lkey;
    ibv_send_wr& swr = swrs[i];
    swr = ibv_send_wr{};
    swr.wr_id = ++last_wr_;
    swr.sg_list = wr.length > 0 ? &sge : nullptr;
    swr.num_sge = wr.length > 0 ? 1 : 0;
    swr.opcode = wr.opcode == Opcode::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    // Only the chain's last one is signaled (selective signaling, see Link).
    swr.send_flags = n + 1 == chain.size() ? IBV_SEND_SIGNALED : 0;
    // Small WRITEs inline: the payload is copied into the work request
    // now, so the NIC fetches nothing (a DMA read saved per request).
    if (wr.opcode == Opcode::kWrite && wr.length > 0 && wr.length <= link.max_inline) {
      swr.send_flags |= IBV_SEND_INLINE;
    }
    swr.wr.rdma.remote_addr = wr.remote_addr;
    swr.wr.rdma.rkey = static_cast<uint32_t>(wr.remote_key);
    if (n > 0) swrs[chain[n - 1]].next = &swr;
  }
}

void VerbsTransport::BooksLocked(Link& link, absl::Span<const WorkRequest> batch,
                                 absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                                 absl::Span<const ibv_send_wr> swrs) {
  // For expiry only (ExpireOld, seconds): the coarse clock, cheaper.
  const absl::Time now = CoarseNow();
  for (const size_t i : chain) {
    ++found[i].region->local_uses;
    ++link.outstanding;
    link.Push(Posted{swrs[i].wr_id, batch[i], now});
  }
}

void VerbsTransport::PostChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                                     absl::Span<const size_t> chain,
                                     absl::Span<const Resolved> found, absl::Span<ibv_send_wr> swrs,
                                     absl::Span<ibv_sge> sges) {
  ChainLocked(link, batch, chain, found, swrs, sges);
  // The doorbell first, the books after: the lock is held throughout, so
  // no completion is drained before the ring holds its request.
  ibv_send_wr* bad = nullptr;
  const absl::Status posted = ibv::PostSend(link.qp.get(), &swrs[chain[0]], &bad);
  BooksLocked(link, batch, chain, found, swrs);
  if (!posted.ok()) FailChainLocked(link, batch, chain, swrs, bad, posted);
}

void VerbsTransport::FailChainLocked(Link& link, absl::Span<const WorkRequest> batch,
                                     absl::Span<const size_t> chain,
                                     absl::Span<ibv_send_wr> swrs, const ibv_send_wr* bad,
                                     const absl::Status& posted) {
  // Validated before, so this is the QP failing: the requests from `bad`
  // on were not posted; report each of them.
  bool failed = false;
  for (const size_t i : chain) {
    ibv_send_wr& swr = swrs[i];
    failed = failed || &swr == bad || bad == nullptr;
    if (!failed) continue;
    --link.outstanding;
    --link.count;  // the ring's newest entries are this chain's tail
    // The link is put in error below: retryable on a new one.
    CompleteLocked(batch[i], absl::UnavailableError(posted.message()));
  }
  // The chain's posted head is unsignaled and its signaled tail was
  // refused: put the QP in error so that its requests flush (errors always
  // complete) instead of waiting for a completion that never comes.
  link.state = Link::State::kError;
  if (absl::Status reset = ibv::ResetToError(link.qp.get()); !reset.ok()) {
    KVF_LOG(WARNING) << "verbs: " << reset;
  }
}

absl::Status VerbsTransport::Post(absl::Span<const WorkRequest> batch) {
  MutexLock lock(&mu_);
  // A small batch's buffers are on the stack: a one-request batch is what a
  // latency-bound caller posts.
  constexpr size_t kOnStack = 4;
  const SmallScratch<Resolved, kOnStack> found_buffer(batch.size());
  const absl::Span<Resolved> found = found_buffer.span();
  RETURN_IF_ERROR(ValidateLocked(batch, found));
  // One ibv_post_send (one doorbell) per link: the batch's requests for a
  // link are chained. Each request is its own work request and completion,
  // so failures stay per request.
  const SmallScratch<ibv_send_wr, kOnStack> swrs_buffer(batch.size());
  const SmallScratch<ibv_sge, kOnStack> sges_buffer(batch.size());
  const SmallScratch<size_t, kOnStack> order_buffer(batch.size());  // batch indices by link
  const absl::Span<ibv_send_wr> swrs = swrs_buffer.span();
  const absl::Span<ibv_sge> sges = sges_buffer.span();
  const absl::Span<size_t> order = order_buffer.span();
  bool grouped = true;  // already in link order (one link, most often)
  for (size_t i = 0; i < batch.size(); ++i) {
    order[i] = i;
    grouped = grouped && (i == 0 || batch[i - 1].link <= batch[i].link);
  }
  // In batch order within a link. std::sort, not stable_sort: stable_sort
  // allocates a buffer on every call.
  if (!grouped) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return batch[a].link != batch[b].link ? batch[a].link < batch[b].link : a < b;
    });
  }
  for (size_t k = 0; k < order.size();) {
    Link& link = *found[order[k]].link;
    size_t end = k;
    while (end < order.size() && batch[order[end]].link == link.id) ++end;
    const absl::Span<const size_t> chain(order.data() + k, end - k);
    PostChainLocked(link, batch, chain, found, swrs, sges);
    k = end;
  }
  return absl::OkStatus();
}

void VerbsTransport::CompleteLocked(const WorkRequest& wr, absl::Status status) {
  cq_.Push(wr, std::move(status));
  cq_cv_.SignalAll();
  if (notify_) notify_();
}

bool VerbsTransport::Drain(size_t nic) {
  ibv_wc wc[32];
  bool any = false;
  for (;;) {
    // Polled under the lock: ReserveCq may resize the CQ.
    MutexLock lock(&mu_);
    absl::StatusOr<int> polled = ibv::PollCq(nics_[nic].cq.get(), 32, wc);
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

void VerbsTransport::DeliverLocked(size_t nic, const ibv_wc& wc) {
  auto link = by_qp_.find(QpKey(nic, wc.qp_num));
  if (link == by_qp_.end()) return;  // closed: its requests were cancelled
  Link& l = *link->second;
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
        status = absl::Status(CodeOf(wc.status),
                              absl::StrFormat("%s (QP %#x, vendor error %#x)",
                                              ibv::WcStatusStr(wc.status), wc.qp_num,
                                              wc.vendor_err));
        l.state = Link::State::kError;
      }
      CompleteLocked(wr, std::move(status));
      return;
    }
    CompleteLocked(wr, absl::OkStatus());
  }
}

void VerbsTransport::ExpireOld() {
  const absl::Time now = CoarseNow();  // as Post stamps requests
  MutexLock lock(&mu_);
  for (auto& [id, link] : links_) {
    Link& l = *link;
    for (size_t i = 0; i < l.count; ++i) {
      Posted& p = l.At(i);
      if (p.done || now - p.posted < options_.request_timeout) continue;
      if (l.state == Link::State::kError) {
        // The QP is in the error state and touches no buffer; its flush
        // completion should have come. A NIC that never sends it (seen with
        // Soft-RoCE while it retransmits to a peer that drops everything)
        // must not hold the request forever.
        if (now - p.posted >= 2 * options_.request_timeout) {
          --l.outstanding;
          p.done = true;
          CompleteLocked(p.wr, absl::AbortedError(absl::StrFormat(
                                   "QP %#x is in the error state and its flush never came",
                                   l.qp->qp_num)));
        }
        continue;
      }
      l.state = Link::State::kError;
      // In the error state the NIC touches no buffer of this QP any more; the
      // other requests come back as flush errors (kAborted).
      if (absl::Status reset = ibv::ResetToError(l.qp.get()); !reset.ok()) {
        KVF_LOG(WARNING) << "verbs: " << reset;
      }
      --l.outstanding;
      p.done = true;
      CompleteLocked(p.wr,
                     absl::UnavailableError(absl::StrFormat(
                         "no completion from the peer within %s on QP %#x: peer presumed gone",
                         absl::FormatDuration(options_.request_timeout), l.qp->qp_num)));
    }
  }
}

void VerbsTransport::PollerLoop() {
  // Sleeps in the kernel until a CQ has news (or 100 ms pass, to check for
  // expired requests and shutdown), re-arms, then drains.
  std::vector<pollfd> fds;
  for (Nic& nic : nics_) fds.push_back(pollfd{nic.channel->fd, POLLIN, 0});
  absl::Time next_expiry_check = absl::Now();
  while (!stopping_) {
    if (absl::Now() >= next_expiry_check) {
      ExpireOld();
      next_expiry_check = absl::Now() + absl::Milliseconds(100);
    }
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (size_t i = 0; i < nics_.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) continue;
      absl::StatusOr<ibv_cq*> event = ibv::GetCqEvent(nics_[i].channel.get());
      if (!event.ok()) continue;  // poll() said readable; a failed read is skipped
      ibv_cq* cq = *event;
      // Re-arm first, so nothing is missed, but only for sleepers (see
      // sleepers_); a thread that goes to sleep later arms for itself.
      if (sleepers_.load() > 0) (void)ibv::ReqNotifyCq(cq, nics_[i].port.device);
      Drain(i);
    }
  }
}

size_t VerbsTransport::PollCompletions(absl::Span<Completion> out) {
  // What the NICs have now, without waiting for the poller thread.
  for (size_t i = 0; i < nics_.size(); ++i) Drain(i);
  MutexLock lock(&mu_);
  return cq_.Pop(out, [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto region = regions_.find(id);
    if (region != regions_.end()) --region->second->local_uses;
  });
}

size_t VerbsTransport::WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) {
  if (size_t n = PollCompletions(out); n > 0 || timeout <= absl::ZeroDuration()) return n;
  // Poll the CQs from this thread for a moment (see busy_poll), then sleep.
  const absl::Time spin_until = FastNow() + std::min(timeout, options_.busy_poll);
  while (FastNow() < spin_until) {
    bool any = interrupted_.exchange(false);
    for (size_t i = 0; i < nics_.size(); ++i) any = Drain(i) || any;
    if (any) return PollCompletions(out);
  }
  // Going to sleep: ask for completion events, then look once more (a
  // completion that came before the request raises no event).
  ++sleepers_;
  for (Nic& nic : nics_) (void)ibv::ReqNotifyCq(nic.cq.get(), nic.port.device);
  bool any = false;
  for (size_t i = 0; i < nics_.size(); ++i) any = Drain(i) || any;
  if (!any) {
    MutexLock lock(&mu_);
    cq_cv_.AwaitWithDeadline(&mu_, FastNow() + timeout, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return !cq_.empty() || interrupted_.load();
    });
  }
  interrupted_.store(false);
  --sleepers_;
  return PollCompletions(out);
}

void VerbsTransport::InterruptWait() {
  MutexLock lock(&mu_);  // a waiter checks the flag under it before sleeping
  interrupted_.store(true);
  cq_cv_.SignalAll();
}


}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
