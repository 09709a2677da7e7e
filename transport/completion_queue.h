// The queue of completions a transport has produced and not yet delivered,
// shared by every implementation. Each entry remembers the request's local
// region, which stays pinned (UnregisterMemory refuses) until the entry is
// delivered. Not thread-safe: the owning transport locks around it.
#ifndef KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_
#define KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_

#include <deque>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

class CompletionQueue {
 public:
  void Push(const WorkRequest& wr, absl::Status status) {
    entries_.push_back(Entry{Completion{wr.cookie, std::move(status)}, wr.local_region});
  }
  bool empty() const { return entries_.empty(); }
  // Moves up to out.size() completions into `out`, calling unpin(region)
  // for each; returns how many.
  template <typename Unpin>
  size_t Pop(absl::Span<Completion> out, Unpin unpin) {
    size_t n = 0;
    while (n < out.size() && !entries_.empty()) {
      unpin(entries_.front().region);
      out[n++] = std::move(entries_.front().completion);
      entries_.pop_front();
    }
    return n;
  }

 private:
  struct Entry {
    Completion completion;
    RegionId region;
  };
  std::deque<Entry> entries_;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_
