// The verbs transport's ChainPoster: posting work requests (chains, one
// doorbell per link, selective signaling).
#include <infiniband/verbs.h>

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
#include "transport/verbs/verbs_transport_internal.h"

namespace kvferry {
namespace transport {
namespace verbs_internal {

absl::Status ChainPoster::ValidateLocked(absl::Span<const WorkRequest> batch,
                                         absl::Span<Resolved> found) {
  for (size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& wr = batch[i];
    auto link = core_.links.find(wr.link);
    RETURN_IF_ERROR(
        CheckLinkUsable(wr.link, link == core_.links.end() ? nullptr : &link->second->state));
    auto region = core_.regions.find(wr.local_region);
    if (region == core_.regions.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
    }
    RETURN_IF_ERROR(CheckLocal(wr, region->second->region, core_.max_request_bytes));
    if (wr.remote_key > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrFormat("remote key %#x is not a verbs rkey", wr.remote_key));
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
      core_.options.max_outstanding_per_link);
}

void ChainPoster::ChainLocked(const VerbsLink& link, absl::Span<const WorkRequest> batch,
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

void ChainPoster::BooksLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
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

void ChainPoster::PostChainLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
                                  absl::Span<const size_t> chain, absl::Span<const Resolved> found,
                                  absl::Span<ibv_send_wr> swrs, absl::Span<ibv_sge> sges) {
  ChainLocked(link, batch, chain, found, swrs, sges);
  // The doorbell first, the books after: the lock is held throughout, so
  // no completion is drained before the ring holds its request.
  ibv_send_wr* bad = nullptr;
  const absl::Status posted = ibv::PostSend(link.qp.get(), &swrs[chain[0]], &bad);
  BooksLocked(link, batch, chain, found, swrs);
  if (!posted.ok()) FailChainLocked(link, batch, chain, swrs, bad, posted);
}

void ChainPoster::FailChainLocked(VerbsLink& link, absl::Span<const WorkRequest> batch,
                                  absl::Span<const size_t> chain, absl::Span<ibv_send_wr> swrs,
                                  const ibv_send_wr* bad, const absl::Status& posted) {
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
    core_.CompleteLocked(batch[i], absl::UnavailableError(posted.message()));
  }
  // The chain's posted head is unsignaled and its signaled tail was
  // refused: put the QP in error so that its requests flush (errors always
  // complete) instead of waiting for a completion that never comes.
  link.state = VerbsLink::State::kError;
  if (absl::Status reset = ibv::ResetToError(link.qp.get()); !reset.ok()) {
    KVF_LOG(WARNING) << "verbs: " << reset;
  }
}

absl::Status ChainPoster::Post(absl::Span<const WorkRequest> batch) {
  MutexLock lock(&core_.mu);
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
    VerbsLink& link = *found[order[k]].link;
    size_t end = k;
    while (end < order.size() && batch[order[end]].link == link.id) ++end;
    const absl::Span<const size_t> chain(order.data() + k, end - k);
    PostChainLocked(link, batch, chain, found, swrs, sges);
    k = end;
  }
  return absl::OkStatus();
}
}  // namespace verbs_internal
}  // namespace transport
}  // namespace kvferry
