// The engine's transports as one source of completions: polls them all,
// and waits in the one transport there is, or (with several) on a count
// their completion notifiers bump (its own lock, taken last).
#ifndef KVFERRY_ENGINE_PIPELINE_COMPLETION_SOURCE_H_
#define KVFERRY_ENGINE_PIPELINE_COMPLETION_SOURCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "engine/pipeline/lanes.h"
#include "engine/pipeline/vias.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

class CompletionSource {
 public:
  // The transports outlive it; with several, their notifiers are set here
  // and cleared by the destructor.
  explicit CompletionSource(const std::vector<Via>* vias);
  ~CompletionSource();
  CompletionSource(const CompletionSource&) = delete;
  CompletionSource& operator=(const CompletionSource&) = delete;

  // What every transport has now, without waiting.
  size_t PollAll(absl::Span<transport::Completion> out);
  // Waits up to `timeout` for completions on every transport.
  size_t WaitAll(absl::Span<transport::Completion> out, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Makes a thread in WaitAll return.
  void InterruptWaits() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::vector<Via>& vias_;
  Mutex mu_{kEventsLock};
  CondVar cv_;
  uint64_t events_ ABSL_GUARDED_BY(mu_) = 0;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;  // see InterruptWaits
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_COMPLETION_SOURCE_H_
