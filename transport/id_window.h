// IdWindow<T>: values keyed by ids handed out in sequence (0, 1, 2, ...)
// that mostly retire in order, as requests on one connection do. A ring
// over the ids from the oldest live one to the newest: lookups are an
// index, and once the ring has grown to the widest window seen, adding and
// erasing allocate nothing. Not thread-safe.
#ifndef KVFERRY_TRANSPORT_ID_WINDOW_H_
#define KVFERRY_TRANSPORT_ID_WINDOW_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvferry {
namespace transport {

template <typename T>
class IdWindow {
 public:
  // Stores `value` under the next id and returns that id.
  uint64_t Add(T value) {
    if (span_ == slots_.size()) Grow();
    const uint64_t id = base_ + span_;
    Slot& s = slots_[id & (slots_.size() - 1)];
    s.value = std::move(value);
    s.live = true;
    ++span_;
    ++live_;
    return id;
  }
  // The value stored under `id`, or null.
  T* Find(uint64_t id) {
    if (id < base_ || id >= base_ + span_) return nullptr;
    Slot& s = slots_[id & (slots_.size() - 1)];
    return s.live ? &s.value : nullptr;
  }
  // Removes `id`; false if it was not there.
  bool Erase(uint64_t id) {
    if (Find(id) == nullptr) return false;
    slots_[id & (slots_.size() - 1)].live = false;
    --live_;
    while (span_ > 0 && !slots_[base_ & (slots_.size() - 1)].live) {
      ++base_;
      --span_;
    }
    return true;
  }
  size_t size() const { return live_; }
  bool empty() const { return live_ == 0; }
  // The oldest live id (the window's start); only when not empty.
  uint64_t first() const { return base_; }
  // Calls fn(id, value) for every live entry, oldest first.
  template <typename Fn>
  void ForEach(Fn fn) {
    for (uint64_t id = base_; id < base_ + span_; ++id) {
      Slot& s = slots_[id & (slots_.size() - 1)];
      if (s.live) fn(id, s.value);
    }
  }
  // Removes everything; ids continue from where they were.
  void Clear() {
    ForEach([](uint64_t, T& v) { v = T(); });
    for (Slot& s : slots_) s.live = false;
    base_ += span_;
    span_ = 0;
    live_ = 0;
  }

 private:
  struct Slot {
    T value{};
    bool live = false;
  };
  void Grow() {
    std::vector<Slot> bigger(slots_.empty() ? 16 : 2 * slots_.size());
    for (uint64_t id = base_; id < base_ + span_; ++id) {
      bigger[id & (bigger.size() - 1)] = std::move(slots_[id & (slots_.size() - 1)]);
    }
    slots_ = std::move(bigger);
  }
  std::vector<Slot> slots_;  // size a power of two
  uint64_t base_ = 0;        // oldest id that may be live
  uint64_t span_ = 0;        // ids [base_, base_ + span_) are in the ring
  size_t live_ = 0;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_ID_WINDOW_H_
