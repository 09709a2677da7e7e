#include "engine/prepared/desc_list.h"

#include <algorithm>

namespace kvferry {
namespace engine_internal {

void DescList::Add(const Entry& e) {
  if (!runs_.empty()) {
    Run& r = runs_.back();
    if (r.length == e.length && r.bound == e.bound && e.addr > r.addr) {
      if (r.count == 1) {
        r.stride = e.addr - r.addr;
        r.count = 2;
        ++size_;
        return;
      }
      if (e.addr - r.addr == r.stride * r.count && (e.addr - r.addr) / r.count == r.stride) {
        ++r.count;
        ++size_;
        return;
      }
    }
  }
  runs_.push_back(Run{size_, 1, e.addr, 0, e.length, e.bound});
  ++size_;
}

size_t DescList::RunOf(uint64_t index) const {
  // Runs of about equal size (a pool's usual list): the guess is right.
  const size_t guess = static_cast<size_t>(index * runs_.size() / size_);
  const Run& g = runs_[guess];
  if (g.first <= index && index - g.first < g.count) return guess;
  auto it = std::upper_bound(runs_.begin(), runs_.end(), index,
                             [](uint64_t i, const Run& r) { return i < r.first; });
  return static_cast<size_t>(it - runs_.begin()) - 1;
}

DescList::Entry DescList::At(uint64_t index) const {
  const Run& r = runs_[RunOf(index)];
  return Entry{r.addr + (index - r.first) * r.stride, r.length, r.bound};
}

}  // namespace engine_internal
}  // namespace kvferry
