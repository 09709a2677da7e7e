#include "engine/prepared/prepared.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "engine/prepared/desc_list.h"
#include "engine/prepared/prepared_internal.h"

namespace kvferry {
namespace engine_internal {

void FinishedQueue::Finished(BatchId batch) {
  MutexLock lock(&mu_);
  if (stopped_) return;
  queue_.push_back(batch);
  cv_.Signal();
}

bool FinishedQueue::TryPop(BatchId* batch) {
  MutexLock lock(&mu_);
  if (queue_.empty() || stopped_) return false;
  *batch = queue_.front();
  queue_.pop_front();
  return true;
}

bool FinishedQueue::Ready() {
  MutexLock lock(&mu_);
  return !queue_.empty() || poked_ || stopped_;
}

bool FinishedQueue::Settle() {
  MutexLock lock(&mu_);
  while (queue_.empty() && !poked_ && !stopped_) cv_.Wait(&mu_);
  poked_ = false;
  return !stopped_;
}

void FinishedQueue::Poke() {
  MutexLock lock(&mu_);
  poked_ = true;
  cv_.Signal();
}

void FinishedQueue::Unpoke() {
  MutexLock lock(&mu_);
  poked_ = false;
}

void FinishedQueue::Stop() {
  MutexLock lock(&mu_);
  stopped_ = true;
  queue_.clear();
  cv_.SignalAll();
}

bool FinishedQueue::stopped() {
  MutexLock lock(&mu_);
  return stopped_;
}

}  // namespace engine_internal

using engine_internal::DescList;

namespace {

struct List {
  bool local = true;
  uint64_t segment = 0;    // remote lists: the segment
  uint64_t engine_id = 0;  // ... and the peer instance it was prepared against
  DescList descs;
};

// One transfer. Its post and state calls are serialized by `op_mu`; the
// announcing thread shares only the notification's progress (`note_mu`).
struct Xfer {
  uint64_t segment = 0;
  uint64_t engine_id = 0;
  std::vector<TransferRequest> requests;  // merged
  uint64_t bytes = 0;

  Mutex op_mu;
  enum class Phase { kNotPosted, kRunning, kFinished };
  Phase phase ABSL_GUARDED_BY(op_mu) = Phase::kNotPosted;
  absl::Status error ABSL_GUARDED_BY(op_mu);  // a finished post's result
  BatchId batch ABSL_GUARDED_BY(op_mu) = 0;
  std::optional<std::string> notification ABSL_GUARDED_BY(op_mu);
  bool announced ABSL_GUARDED_BY(op_mu) = false;  // the running post sends it
  absl::Time start ABSL_GUARDED_BY(op_mu);
  absl::Duration post ABSL_GUARDED_BY(op_mu);
  absl::Duration transfer ABSL_GUARDED_BY(op_mu);
  bool measured ABSL_GUARDED_BY(op_mu) = false;
  engine_internal::PlanCache plan ABSL_GUARDED_BY(op_mu);  // its slices, from the last post
  // Set by Release: a thread that found it just before (through its last
  // found transfer, or the map) reports it unknown.
  bool released ABSL_GUARDED_BY(op_mu) = false;

  Mutex note_mu;
  bool note_pending ABSL_GUARDED_BY(note_mu) = false;
  absl::Status note_result ABSL_GUARDED_BY(note_mu);
  std::string note_message ABSL_GUARDED_BY(note_mu);
};

absl::Status NoSuch(const char* what, uint64_t id) {
  return absl::NotFoundError(absl::StrCat("no prepared ", what, " ", id));
}

}  // namespace

class PreparedTransfers::Impl {
 public:
  explicit Impl(const Deps& deps) : d_(deps) {
    d_.pipeline->SetFinishedHook(d_.finished);
    announcer_ = std::thread([this] { Announce(); });
  }
  ~Impl() {
    d_.finished->Stop();
    announcer_.join();
  }

  absl::StatusOr<uint64_t> PrepareLocal(absl::Span<const Descriptor> descs) {
    if (descs.empty()) return absl::InvalidArgumentError("PrepareLocal: an empty list");
    auto list = std::make_shared<List>();
    uint64_t lo = 1, end = 0;  // the registration found last: [lo, end) lies in it
    for (size_t i = 0; i < descs.size(); ++i) {
      const Descriptor& e = descs[i];
      const bool in_last = e.addr >= lo && e.length <= end - e.addr && e.addr < end;
      if (!in_last) {
        end = e.length == 0 ? 0 : d_.regions->RegistrationEnd(e.addr, e.length);
        lo = e.addr;
      }
      if (end == 0) {
        return absl::NotFoundError(absl::StrFormat(
            "PrepareLocal: entry %u [%#x, +%u) is %s", i, e.addr, e.length,
            e.length == 0 ? "empty" : "not inside memory registered on this engine"));
      }
      list->descs.Add({e.addr, e.length, end});
    }
    return Keep(std::move(list));
  }

  absl::StatusOr<uint64_t> PrepareRemote(uint64_t segment, absl::Span<const Descriptor> descs) {
    if (descs.empty()) return absl::InvalidArgumentError("PrepareRemote: an empty list");
    bool refreshed = false;
    for (int attempt = 0; attempt < 8; ++attempt) {
      ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView before,
                       d_.pipeline->segments().View(segment));
      ASSIGN_OR_RETURN(std::vector<RemoteRegion> regions, d_.pipeline->segments().Regions(segment));
      ASSIGN_OR_RETURN(engine_internal::SegmentRegistry::PeerView after,
                       d_.pipeline->segments().View(segment));
      if (before.generation != after.generation) continue;  // refreshed meanwhile: read again
      auto list = std::make_shared<List>();
      list->local = false;
      list->segment = segment;
      list->engine_id = after.engine_id;
      absl::Status uncovered = CoverRemote(std::move(regions), descs, &list->descs);
      if (uncovered.ok()) return Keep(std::move(list));
      if (refreshed) return uncovered;
      // The peer may have registered more since its last handshake: ask once.
      refreshed = true;
      bool changed;
      RETURN_IF_ERROR(d_.pipeline->segments().Refresh(segment, &changed));
    }
    return absl::UnavailableError(
        absl::StrCat("PrepareRemote: segment ", segment, " keeps changing"));
  }

  absl::Status ReleaseList(uint64_t id) {
    MutexLock lock(&mu_);
    if (lists_.erase(id) == 0) return NoSuch("list", id);
    return absl::OkStatus();
  }

  absl::StatusOr<std::pair<uint64_t, size_t>> ListSize(uint64_t id) const {
    MutexLock lock(&mu_);
    auto it = lists_.find(id);
    if (it == lists_.end()) return NoSuch("list", id);
    return std::make_pair(it->second->descs.size(), it->second->descs.runs());
  }

  absl::StatusOr<uint64_t> Make(transport::Opcode op, uint64_t local_id,
                                absl::Span<const int64_t> li, uint64_t remote_id,
                                absl::Span<const int64_t> ri, const MakeOptions& options) {
    std::shared_ptr<const List> local, remote;
    {
      MutexLock lock(&mu_);
      auto l = lists_.find(local_id);
      if (l == lists_.end()) return NoSuch("list", local_id);
      auto r = lists_.find(remote_id);
      if (r == lists_.end()) return NoSuch("list", remote_id);
      local = l->second;
      remote = r->second;
    }
    if (!local->local || remote->local) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Make: list ", local_id, " must be a local one and list ", remote_id, " a remote one"));
    }
    if (li.size() != ri.size() || li.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("Make: ", li.size(), " local and ", ri.size(),
                                                     " remote indices (equal, not 0)"));
    }
    if (op != transport::Opcode::kRead && op != transport::Opcode::kWrite) {
      return absl::InvalidArgumentError("Make: the operation must be READ or WRITE");
    }
    auto x = std::make_unique<Xfer>();
    x->segment = remote->segment;
    x->engine_id = remote->engine_id;
    x->requests.reserve(options.merge ? 16 : li.size());
    uint64_t lbound = 0, rbound = 0;  // the last request's covering memory
    for (size_t k = 0; k < li.size(); ++k) {
      if (li[k] < 0 || static_cast<uint64_t>(li[k]) >= local->descs.size() || ri[k] < 0 ||
          static_cast<uint64_t>(ri[k]) >= remote->descs.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Make: pair ", k, " (", li[k], ", ", ri[k], ") is out of range: the lists hold ",
            local->descs.size(), " and ", remote->descs.size(), " entries"));
      }
      const DescList::Entry le = local->descs.At(static_cast<uint64_t>(li[k]));
      const DescList::Entry re = remote->descs.At(static_cast<uint64_t>(ri[k]));
      if (le.length != re.length) {
        return absl::InvalidArgumentError(absl::StrCat("Make: pair ", k, " (", li[k], ", ", ri[k],
                                                       ") has lengths ", le.length, " and ",
                                                       re.length));
      }
      x->bytes += le.length;
      if (options.merge && !x->requests.empty()) {
        TransferRequest& last = x->requests.back();
        const uint64_t lend = reinterpret_cast<uintptr_t>(last.local) + last.length;
        if (lend == le.addr && last.remote + last.length == re.addr && le.bound == lbound &&
            re.bound == rbound) {
          last.length += le.length;
          continue;
        }
      }
      x->requests.push_back(TransferRequest{
          op, reinterpret_cast<void*>(static_cast<uintptr_t>(le.addr)), re.addr, le.length});
      lbound = le.bound;
      rbound = re.bound;
    }
    x->requests.shrink_to_fit();
    {
      MutexLock lock(&x->op_mu);
      x->notification = options.notification;
    }
    MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    xfers_.emplace(id, std::shared_ptr<Xfer>(std::move(x)));
    return id;
  }

  absl::StatusOr<XferState> Post(uint64_t id, const std::optional<std::string>& notification) {
    ASSIGN_OR_RETURN(std::shared_ptr<Xfer> x, Find(id));
    MutexLock op_lock(&x->op_mu);
    if (x->released) return NoSuch("transfer", id);
    if (x->phase == Xfer::Phase::kRunning) {
      Advance(*x);
      if (x->phase == Xfer::Phase::kRunning) {
        return absl::AlreadyExistsError(
            absl::StrCat("transfer ", id, " is still in progress: post it again once it is done"));
      }
    }
    if (notification.has_value()) x->notification = notification;
    x->measured = false;
    x->announced = x->notification.has_value();
    if (x->announced) {
      MutexLock note_lock(&x->note_mu);
      x->note_pending = true;
      x->note_result = absl::OkStatus();
      x->note_message = *x->notification;
    }
    // Its start: when the pipeline read the clock before the first
    // doorbell (no read of our own on the way to it).
    x->start = absl::InfinitePast();
    absl::StatusOr<BatchId> batch = d_.pipeline->Submit(
        x->segment, x->requests, engine_internal::PeerBinding{x->engine_id, {}, x->announced},
        &x->plan, &x->start);
    const absl::Time posted = d_.clock->Now();
    if (x->start == absl::InfinitePast()) x->start = posted;  // refused before a doorbell
    x->post = posted - x->start;
    if (!batch.ok()) {
      if (x->announced) {
        {
          MutexLock note_lock(&x->note_mu);
          x->note_pending = false;
        }
        // Its batch may have ended and been told before it was given up:
        // the announcing thread forgets such batches (PruneEarly).
        d_.finished->Poke();
      }
      x->phase = Xfer::Phase::kFinished;
      x->error = batch.status();
      return x->error;
    }
    x->batch = *batch;
    x->phase = Xfer::Phase::kRunning;
    if (x->announced) {
      {
        MutexLock lock(&mu_);
        // It may have finished already (and been told before this was known).
        if (early_.erase(*batch) != 0) d_.finished->Finished(*batch);
        by_batch_[*batch] = x;
      }
      d_.finished->Poke();  // drive its completions
    }
    return XferState::kInProgress;
  }

  absl::StatusOr<XferState> State(uint64_t id) {
    ASSIGN_OR_RETURN(std::shared_ptr<Xfer> x, Find(id));
    MutexLock op_lock(&x->op_mu);
    if (x->released) return NoSuch("transfer", id);
    Advance(*x);
    switch (x->phase) {
      case Xfer::Phase::kNotPosted:
        return XferState::kNotPosted;
      case Xfer::Phase::kRunning:
        return XferState::kInProgress;
      case Xfer::Phase::kFinished:
        break;
    }
    if (!x->error.ok()) return x->error;
    return XferState::kDone;
  }

  absl::StatusOr<XferTelemetry> Telemetry(uint64_t id) {
    ASSIGN_OR_RETURN(std::shared_ptr<Xfer> x, Find(id));
    MutexLock op_lock(&x->op_mu);
    if (x->released) return NoSuch("transfer", id);
    if (x->phase == Xfer::Phase::kFinished && !x->error.ok()) return x->error;
    if (!x->measured) {
      return absl::FailedPreconditionError(
          absl::StrCat("transfer ", id, " has no finished post yet"));
    }
    return XferTelemetry{x->start, x->post, x->transfer, x->bytes, x->requests.size()};
  }

  absl::Status Release(uint64_t id) {
    ASSIGN_OR_RETURN(std::shared_ptr<Xfer> x, Find(id));
    {
      MutexLock op_lock(&x->op_mu);
      if (x->released) return NoSuch("transfer", id);
      Advance(*x);
      if (x->phase == Xfer::Phase::kRunning) {
        return absl::AlreadyExistsError(
            absl::StrCat("transfer ", id, " is still in progress; it stays until it is done"));
      }
      x->released = true;  // no Post starts it again meanwhile
    }
    MutexLock lock(&mu_);
    xfers_.erase(id);
    return absl::OkStatus();
  }

 private:
  uint64_t Keep(std::shared_ptr<List> list) {
    MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    lists_.emplace(id, std::move(list));
    return id;
  }

  // A thread's last found transfer: posting and polling one transfer again
  // and again, as a serving loop does, skips the agent-wide lock and map.
  // Keyed by the agent's serial (unique per agent, so another agent's ids
  // never match) and held weakly (it keeps no released transfer alive).
  struct LastFound {
    uint64_t serial = 0;
    uint64_t id = 0;
    std::weak_ptr<Xfer> xfer;
  };
  static LastFound& Last() {
    thread_local LastFound last;
    return last;
  }
  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }

  // The caller checks `released` under the transfer's op_mu.
  absl::StatusOr<std::shared_ptr<Xfer>> Find(uint64_t id) {
    LastFound& last = Last();
    if (last.serial == serial_ && last.id == id) {
      if (std::shared_ptr<Xfer> x = last.xfer.lock()) return x;
    }
    std::shared_ptr<Xfer> x;
    {
      MutexLock lock(&mu_);
      auto it = xfers_.find(id);
      if (it == xfers_.end()) return NoSuch("transfer", id);
      x = it->second;
    }
    last = LastFound{serial_, id, x};
    return x;
  }

  // Each entry inside the peer's regions (adjacent ones count as one span).
  static absl::Status CoverRemote(std::vector<RemoteRegion> regions,
                                  absl::Span<const Descriptor> descs, DescList* out) {
    std::sort(regions.begin(), regions.end(),
              [](const RemoteRegion& a, const RemoteRegion& b) { return a.addr < b.addr; });
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // [begin, end)
    for (const RemoteRegion& r : regions) {
      if (!spans.empty() && spans.back().second == r.addr) {
        spans.back().second += r.length;
      } else {
        spans.emplace_back(r.addr, r.addr + r.length);
      }
    }
    for (size_t i = 0; i < descs.size(); ++i) {
      const Descriptor& e = descs[i];
      auto it = std::upper_bound(
          spans.begin(), spans.end(), e.addr,
          [](uint64_t a, const std::pair<uint64_t, uint64_t>& s) { return a < s.first; });
      const bool inside = e.length > 0 && it != spans.begin() && e.addr < (it - 1)->second &&
                          e.length <= (it - 1)->second - e.addr;
      if (!inside) {
        return absl::NotFoundError(
            absl::StrFormat("PrepareRemote: entry %u [%#x, +%u) is %s", i, e.addr, e.length,
                            e.length == 0 ? "empty" : "not inside the memory the peer registered"));
      }
      out->Add({e.addr, e.length, (it - 1)->second});
    }
    return absl::OkStatus();
  }

  // A running post's progress: finished once the batch is, and its
  // notification (if any) went out.
  void Advance(Xfer& x) ABSL_EXCLUSIVE_LOCKS_REQUIRED(x.op_mu) {
    if (x.phase != Xfer::Phase::kRunning) return;
    if (x.announced) {
      // The announcing thread keeps the batch until the word is sent.
      MutexLock note_lock(&x.note_mu);
      if (x.note_pending) return;
    }
    absl::Status result;
    absl::StatusOr<bool> done = d_.pipeline->FinishIfDone(x.batch, &result, /*release=*/true);
    if (!done.ok()) {
      result = done.status();
    } else if (!*done) {
      return;
    } else if (x.announced && result.ok()) {
      MutexLock note_lock(&x.note_mu);
      result = x.note_result;
    }
    x.phase = Xfer::Phase::kFinished;
    x.error = std::move(result);
    x.transfer = d_.clock->Now() - x.start;
    x.measured = true;
  }

  // The announcing thread. While posts with a notification run, it drives
  // the transports' completions itself (nobody else may be polling), and
  // sends each one's notification once every byte is in place.
  void Announce() {
    for (;;) {
      BatchId batch;
      while (d_.finished->TryPop(&batch)) Announce(batch);
      PruneEarly();
      bool running;
      {
        MutexLock lock(&mu_);
        running = !by_batch_.empty();
      }
      if (running) {
        d_.finished->Unpoke();
        d_.pipeline->Drive([this] { return d_.finished->Ready(); }, absl::Milliseconds(100));
        if (d_.finished->stopped()) return;
      } else if (!d_.finished->Settle()) {
        return;
      }
    }
  }
  void Announce(BatchId batch) {
    std::shared_ptr<Xfer> x;
    {
      MutexLock lock(&mu_);
      auto it = by_batch_.find(batch);
      if (it == by_batch_.end()) {
        early_.insert(batch);  // Post has not recorded it yet
        return;
      }
      x = std::move(it->second);
      by_batch_.erase(it);
    }
    absl::Status sent, failed;
    // Done (it was told so), and kept until the post's State sees the
    // notification sent.
    absl::StatusOr<bool> done = d_.pipeline->FinishIfDone(batch, &failed, /*release=*/false);
    std::string message;
    {
      MutexLock note_lock(&x->note_mu);
      message = x->note_message;
    }
    if (!done.ok()) {
      sent = done.status();
    } else if (!failed.ok()) {
      sent = absl::OkStatus();  // nothing to announce: the post failed
    } else {
      sent = d_.notify(x->segment, message, x->engine_id);
      if (!sent.ok()) {
        sent = absl::Status(sent.code(), absl::StrCat("the transfer's data is in place, but its "
                                                      "notification was not delivered: ",
                                                      sent.message()));
      }
    }
    MutexLock note_lock(&x->note_mu);
    x->note_result = std::move(sent);
    x->note_pending = false;
  }
  // Forgets batches told finished that no post will record: their submit
  // failed after they ended (the pipeline recycled them). Those a post is
  // about to record are still known to the pipeline, and stay.
  void PruneEarly() {
    std::vector<BatchId> ids;
    {
      MutexLock lock(&mu_);
      if (early_.empty()) return;
      ids.assign(early_.begin(), early_.end());
    }
    for (BatchId b : ids) {
      if (d_.pipeline->Target(b).status().code() != absl::StatusCode::kNotFound) continue;
      MutexLock lock(&mu_);
      early_.erase(b);
    }
  }

  const Deps d_;
  const uint64_t serial_ = NextSerial();  // this agent's, for LastFound
  mutable Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<const List>> lists_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Xfer>> xfers_ ABSL_GUARDED_BY(mu_);
  // Posts whose notification waits for their batch; batches told finished
  // before their post recorded them.
  absl::flat_hash_map<BatchId, std::shared_ptr<Xfer>> by_batch_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<BatchId> early_ ABSL_GUARDED_BY(mu_);
  std::thread announcer_;
};

PreparedTransfers::PreparedTransfers(const Deps& deps) : impl_(std::make_unique<Impl>(deps)) {}
PreparedTransfers::~PreparedTransfers() = default;

absl::StatusOr<uint64_t> PreparedTransfers::PrepareLocal(absl::Span<const Descriptor> d) {
  return impl_->PrepareLocal(d);
}
absl::StatusOr<uint64_t> PreparedTransfers::PrepareRemote(uint64_t segment,
                                                          absl::Span<const Descriptor> d) {
  return impl_->PrepareRemote(segment, d);
}
absl::Status PreparedTransfers::ReleaseList(uint64_t list) { return impl_->ReleaseList(list); }
absl::StatusOr<std::pair<uint64_t, size_t>> PreparedTransfers::ListSize(uint64_t list) const {
  return impl_->ListSize(list);
}
absl::StatusOr<uint64_t> PreparedTransfers::Make(transport::Opcode op, uint64_t local_list,
                                                 absl::Span<const int64_t> local_indices,
                                                 uint64_t remote_list,
                                                 absl::Span<const int64_t> remote_indices,
                                                 const MakeOptions& options) {
  return impl_->Make(op, local_list, local_indices, remote_list, remote_indices, options);
}
absl::StatusOr<XferState> PreparedTransfers::Post(uint64_t xfer,
                                                  const std::optional<std::string>& notification) {
  return impl_->Post(xfer, notification);
}
absl::StatusOr<XferState> PreparedTransfers::State(uint64_t xfer) { return impl_->State(xfer); }
absl::StatusOr<XferTelemetry> PreparedTransfers::Telemetry(uint64_t xfer) {
  return impl_->Telemetry(xfer);
}
absl::Status PreparedTransfers::Release(uint64_t xfer) { return impl_->Release(xfer); }

}  // namespace kvferry
