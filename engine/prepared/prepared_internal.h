// What the engine gives PreparedTransfers, and the queue of finished
// announced batches (their notifications go out from it).
#ifndef KVFERRY_ENGINE_PREPARED_PREPARED_INTERNAL_H_
#define KVFERRY_ENGINE_PREPARED_PREPARED_INTERNAL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "engine/memory/local_regions.h"
#include "engine/pipeline/batch_pipeline.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/lock_order.h"
#include "engine/prepared/prepared.h"

namespace kvferry {
namespace engine_internal {

// Batches submitted with PeerBinding::announce that finished, in the order
// they did. Told under a lane's lock (FinishedBatches): its own lock is the
// last in the pipeline's order, and nothing is taken under it.
class FinishedQueue final : public FinishedBatches {
 public:
  void Finished(BatchId batch) override ABSL_LOCKS_EXCLUDED(mu_);
  // The next one, if any.
  bool TryPop(BatchId* batch) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether TryPop has one, or the queue was poked or stopped since the
  // last Settle.
  bool Ready() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until Ready; false once stopped. Clears the poke.
  bool Settle() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes Settle (something new to drive for).
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);
  void Unpoke() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes Settle for good.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  bool stopped() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Mutex mu_{kFinishedLock};
  CondVar cv_;
  std::deque<BatchId> queue_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace engine_internal

struct PreparedTransfers::Deps {
  engine_internal::BatchPipeline* pipeline = nullptr;
  const engine_internal::LocalRegions* regions = nullptr;
  // Outlives the pipeline (it is the pipeline's hook).
  engine_internal::FinishedQueue* finished = nullptr;
  Clock* clock = nullptr;
  // Sends `message` to segment `segment`'s peer, refused unless it is the
  // instance `target` (TransferEngine::Notify).
  std::function<absl::Status(uint64_t segment, const std::string& message, uint64_t target)> notify;
};

namespace engine_internal {
using PreparedDeps = PreparedTransfers::Deps;
}  // namespace engine_internal

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PREPARED_PREPARED_INTERNAL_H_
