#include "engine/pipeline/completion_source.h"

#include "base/clock.h"

namespace kvferry {
namespace engine_internal {

using transport::Completion;

CompletionSource::CompletionSource(const std::vector<Via>* vias) : vias_(*vias) {
  if (vias_.size() < 2) return;
  for (const Via& v : vias_) {
    v.transport->SetCompletionNotifier([this] {
      MutexLock lock(&mu_);
      ++events_;
      cv_.SignalAll();
    });
  }
}

CompletionSource::~CompletionSource() {
  // The transports outlive the source: no notifier may run after this.
  if (vias_.size() < 2) return;
  for (const Via& v : vias_) v.transport->SetCompletionNotifier(nullptr);
}

size_t CompletionSource::WaitAll(absl::Span<Completion> out, absl::Duration timeout) {
  if (vias_.size() == 1) return vias_[0].transport->WaitCompletions(out, timeout);
  uint64_t seen;
  {
    MutexLock lock(&mu_);
    seen = events_;
  }
  size_t n = PollAll(out);
  if (n > 0 || timeout <= absl::ZeroDuration()) return n;
  {
    // The transports' notifiers bump events_ after queueing completions.
    MutexLock lock(&mu_);
    cv_.AwaitWithDeadline(&mu_, FastNow() + timeout, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return events_ != seen || interrupted_;
    });
    interrupted_ = false;
  }
  return PollAll(out);
}

size_t CompletionSource::PollAll(absl::Span<Completion> out) {
  size_t n = 0;
  for (const Via& v : vias_) n += v.transport->PollCompletions(out.subspan(n));
  return n;
}

void CompletionSource::InterruptWaits() {
  if (vias_.size() == 1) return vias_[0].transport->InterruptWait();
  MutexLock lock(&mu_);
  interrupted_ = true;
  cv_.SignalAll();
}

}  // namespace engine_internal
}  // namespace kvferry
