#include "engine/stream_order.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "cuda/driver.h"

namespace kvferry {
namespace engine_internal {
namespace {

// What a gate holds until it ran: its job and the state it shares.
struct GateArg {
  std::shared_ptr<StreamOrder::Shared> shared;
  std::shared_ptr<StreamOrder::Job> job;
};

}  // namespace

// The first failed request's error, for the log.
static std::string FirstError(const absl::StatusOr<BatchStatus>& result) {
  if (!result.ok()) return result.status().ToString();
  for (const absl::Status& r : result->requests) {
    if (!r.ok()) return r.ToString();
  }
  return "unknown";
}

StreamOrder::StreamOrder(Run run, Release release)
    : run_(std::move(run)), release_(std::move(release)), shared_(std::make_shared<Shared>()) {}

StreamOrder::~StreamOrder() {
  {
    MutexLock lock(&shared_->mu);
    shared_->closed = true;
    // Jobs the stream has not reached (or that wait for this thread) end
    // here; their gates return at once when the stream gets to them.
    for (auto& [id, job] : shared_->jobs) {
      if (job->state == Job::State::kQueued || job->state == Job::State::kReached) {
        job->state = Job::State::kDone;
        job->result = absl::CancelledError(
            "the engine was destroyed before the stream reached this transfer");
      }
    }
    shared_->reached.clear();
    shared_->cv.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

// On the driver's thread, once the stream's earlier work finished. No CUDA
// call may be made here.
void StreamOrder::Gate(void* p) {
  std::unique_ptr<GateArg> arg(static_cast<GateArg*>(p));
  Shared& s = *arg->shared;
  Job& job = *arg->job;
  MutexLock lock(&s.mu);
  if (job.state == Job::State::kQueued) {
    job.state = Job::State::kReached;
    s.reached.push_back(arg->job);
    s.cv.SignalAll();
  }
  if (!job.options.hold_stream) return;
  // The batch's own bound, and a second for the hand-offs: the stream is
  // never held longer.
  const absl::Time deadline = absl::Now() + job.options.timeout + absl::Seconds(1);
  s.cv.AwaitWithDeadline(&s.mu, deadline,
                         [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
                           return job.state == Job::State::kDone;
                         });
}

absl::StatusOr<uint64_t> StreamOrder::Submit(SegmentId segment,
                                             absl::Span<const TransferRequest> requests,
                                             void* stream, int device,
                                             const StreamOptions& options) {
  const cuda::Driver* driver = cuda::Driver::Get();
  if (driver == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a stream-ordered transfer needs a CUDA driver: ", cuda::Driver::LoadError().message()));
  }
  if (requests.empty()) return absl::InvalidArgumentError("no requests");
  auto job = std::make_shared<Job>();
  job->segment = segment;
  job->requests.assign(requests.begin(), requests.end());
  job->options = options;
  {
    MutexLock lock(&shared_->mu);
    if (shared_->closed) return absl::FailedPreconditionError("the engine is closing");
    if (shared_->jobs.size() >= kMaxJobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          kMaxJobs, " stream-ordered transfers outstanding (queued, running or not yet waited "
                    "for): wait for some first"));
    }
    if (!thread_.joinable()) {
      ASSIGN_OR_RETURN(thread_, StartThread("stream-ordered transfers", [this] { Loop(); }));
    }
    job->id = shared_->next_id++;
    shared_->jobs[job->id] = job;
  }
  auto* arg = new GateArg{shared_, job};
  absl::Status launched = driver->LaunchHostFunc(stream, device, &StreamOrder::Gate, arg);
  if (!launched.ok()) {
    delete arg;
    MutexLock lock(&shared_->mu);
    shared_->jobs.erase(job->id);
    return Annotate(launched, "SubmitOnStream");
  }
  return job->id;
}

void StreamOrder::ReleaseStale() {
  std::vector<BatchId> left;
  for (BatchId b : stale_) {
    if (release_(b).code() == absl::StatusCode::kFailedPrecondition) left.push_back(b);
  }
  stale_.swap(left);
}

void StreamOrder::Loop() {
  MutexLock lock(&shared_->mu);
  for (;;) {
    while (!shared_->closed && shared_->reached.empty()) {
      if (stale_.empty()) {
        shared_->cv.Wait(&shared_->mu);
        continue;
      }
      shared_->mu.Unlock();
      ReleaseStale();
      shared_->mu.Lock();
      if (!stale_.empty()) (void)shared_->cv.WaitWithTimeout(&shared_->mu, absl::Milliseconds(100));
    }
    if (shared_->reached.empty()) return;  // closed
    std::shared_ptr<Job> job = shared_->reached.front();
    shared_->reached.erase(shared_->reached.begin());
    if (job->state != Job::State::kReached) continue;
    job->state = Job::State::kRunning;
    shared_->mu.Unlock();
    BatchId running = 0;
    absl::StatusOr<BatchStatus> result =
        run_(job->segment, job->requests, job->options.timeout, &running);
    if (running != 0) stale_.push_back(running);
    shared_->mu.Lock();
    job->result = std::move(result);
    job->state = Job::State::kDone;
    if (!job->options.keep_result) {
      if (!job->result.ok() || !job->result->ok()) {
        KVF_LOG(WARNING) << "stream-ordered transfer failed: " << FirstError(job->result);
      }
      shared_->jobs.erase(job->id);
    }
    shared_->cv.SignalAll();
  }
}

absl::StatusOr<BatchStatus> StreamOrder::Wait(uint64_t id, absl::Duration timeout) {
  MutexLock lock(&shared_->mu);
  auto it = shared_->jobs.find(id);
  if (it == shared_->jobs.end() || !it->second->options.keep_result) {
    return absl::NotFoundError(absl::StrCat("no stream-ordered transfer ", id));
  }
  std::shared_ptr<Job> job = it->second;
  const bool done = shared_->cv.AwaitWithDeadline(
      &shared_->mu, absl::Now() + timeout,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return job->state == Job::State::kDone; });
  if (!done) {
    return absl::DeadlineExceededError(absl::StrCat(
        "stream-ordered transfer ", id,
        job->state == Job::State::kQueued ? ": the stream has not reached it yet"
                                          : ": still running"));
  }
  shared_->jobs.erase(id);
  return std::move(job->result);
}

}  // namespace engine_internal
}  // namespace kvferry
