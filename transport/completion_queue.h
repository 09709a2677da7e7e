// The queue of completions a transport has produced and not yet delivered,
// shared by every implementation. Each entry remembers the request's local
// region, which stays pinned (UnregisterMemory refuses) until the entry is
// delivered. Not thread-safe: the owning transport locks around it.
#ifndef KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_
#define KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_

#include <vector>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

// A ring buffer: once it has grown to the most completions ever queued at
// once, pushing and popping allocate nothing.
class CompletionQueue {
 public:
  void Push(const WorkRequest& wr, absl::Status status) {
    if (size_ == ring_.size()) Grow();
    Entry& e = ring_[(head_ + size_) & (ring_.size() - 1)];
    e.completion = Completion{wr.cookie, std::move(status)};
    e.region = wr.local_region;
    ++size_;
  }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  // Moves up to out.size() completions into `out`, calling unpin(region)
  // for each; returns how many.
  template <typename Unpin>
  size_t Pop(absl::Span<Completion> out, Unpin unpin) {
    size_t n = 0;
    while (n < out.size() && size_ > 0) {
      Entry& e = ring_[head_];
      unpin(e.region);
      out[n++] = std::move(e.completion);
      e.completion.status = absl::OkStatus();  // drop an error's payload now
      head_ = (head_ + 1) & (ring_.size() - 1);
      --size_;
    }
    return n;
  }

 private:
  struct Entry {
    Completion completion;
    RegionId region = 0;
  };
  void Grow() {
    std::vector<Entry> bigger(ring_.empty() ? 64 : 2 * ring_.size());
    for (size_t i = 0; i < size_; ++i) {
      bigger[i] = std::move(ring_[(head_ + i) & (ring_.size() - 1)]);
    }
    ring_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<Entry> ring_;  // size a power of two
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_COMPLETION_QUEUE_H_
