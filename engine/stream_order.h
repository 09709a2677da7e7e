// Stream-ordered transfers: a batch that starts only once the work already
// queued on a caller's CUDA stream has finished (TransferEngine::
// SubmitOnStream). Internal to the engine.
//
// How: the driver is asked to call a gate function on the stream
// (cuLaunchHostFunc), behind the work already queued there. The driver runs
// it on a thread of its own once that work finished; the gate makes no CUDA
// call (the driver forbids it there): it hands the job to this class's
// thread, which submits the batch and waits for it. With `hold_stream` the
// gate then waits, without calling CUDA, until the batch finished or its
// timeout passed, so that the stream's later work (a kernel reusing the
// buffer, a stream synchronization) comes after the transfer.
//
// LIFESPAN AND OWNERSHIP: a queued job outlives this object: its gate may
// run after the engine is gone. The gate and the job share state by
// reference count; destroying a StreamOrder ends every job the stream has
// not reached yet with kCancelled (its gate then returns at once) and
// waits for the one being submitted.
#ifndef KVFERRY_ENGINE_STREAM_ORDER_H_
#define KVFERRY_ENGINE_STREAM_ORDER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "engine/transfer_engine.h"

namespace kvferry {
namespace engine_internal {

class StreamOrder {
 public:
  // Runs a batch to its end: Submit, wait up to the timeout, release. A
  // batch still running at the timeout is not released: its id goes to
  // `*running` (and kDeadlineExceeded is returned), and Release is asked
  // again later until it takes it.
  using Run = std::function<absl::StatusOr<BatchStatus>(
      SegmentId, const std::vector<TransferRequest>&, absl::Duration, BatchId* running)>;
  using Release = std::function<absl::Status(BatchId)>;
  // At most this many stream-ordered batches at once (queued, running, or
  // finished and not yet waited for).
  static constexpr size_t kMaxJobs = 4096;

  StreamOrder(Run run, Release release);
  ~StreamOrder() ABSL_LOCKS_EXCLUDED(shared_->mu);
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Queues the batch behind `stream`'s work (a CUstream of device
  // `device`). kFailedPrecondition without a CUDA driver,
  // kResourceExhausted past kMaxJobs, the driver's error when it refuses
  // the call. `keep`: Wait collects the result; else it is dropped when
  // done (a failure is logged).
  absl::StatusOr<uint64_t> Submit(SegmentId segment, absl::Span<const TransferRequest> requests,
                                  void* stream, int device, const StreamOptions& options)
      ABSL_LOCKS_EXCLUDED(shared_->mu);
  // The batch's outcome, once the stream reached it and it finished:
  // the batch's status, or why it could not be submitted (Submit's errors,
  // kCancelled when the engine closed first). kDeadlineExceeded when that
  // has not happened within `timeout` (the job stays); kNotFound for an id
  // that is unknown or was collected already.
  absl::StatusOr<BatchStatus> Wait(uint64_t id, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(shared_->mu);

  // A batch waiting for its stream, running, or done.
  struct Job {
    enum class State { kQueued, kReached, kRunning, kDone };
    uint64_t id = 0;
    SegmentId segment = 0;
    std::vector<TransferRequest> requests;
    StreamOptions options;
    State state = State::kQueued;
    absl::StatusOr<BatchStatus> result = absl::UnknownError("not run");
  };
  // What the gates (on the driver's thread) and this object share.
  struct Shared {
    Mutex mu;
    CondVar cv;  // a job reached, finished or collected; closing
    bool closed ABSL_GUARDED_BY(mu) = false;
    std::vector<std::shared_ptr<Job>> reached ABSL_GUARDED_BY(mu);  // to submit, in order
    std::map<uint64_t, std::shared_ptr<Job>> jobs ABSL_GUARDED_BY(mu);
    uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  };

 private:
  static void Gate(void* arg);
  void Loop() ABSL_LOCKS_EXCLUDED(shared_->mu);
  // Releases the timed-out batches that have finished since.
  void ReleaseStale();

  const Run run_;
  const Release release_;
  const std::shared_ptr<Shared> shared_;
  std::vector<BatchId> stale_;  // timed out, still running (Loop's thread only)
  std::thread thread_;  // started with the first job
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_STREAM_ORDER_H_
