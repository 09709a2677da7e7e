// Scratch<T>: a std::vector<T> borrowed from a per-thread pool and given
// back (emptied, capacity kept) when the Scratch goes out of scope. Hot
// paths use it for temporary lists so that, once warm, they allocate
// nothing; nesting (a hot path calling another) takes a second vector.
#ifndef KVFERRY_BASE_SCRATCH_H_
#define KVFERRY_BASE_SCRATCH_H_

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace kvferry {

template <typename T>
class Scratch {
 public:
  Scratch() {
    std::vector<std::vector<T>>& pool = Pool();
    if (!pool.empty()) {
      v_ = std::move(pool.back());
      pool.pop_back();
    }
  }
  ~Scratch() {
    v_.clear();
    Pool().push_back(std::move(v_));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::vector<T>& operator*() { return v_; }
  std::vector<T>* operator->() { return &v_; }

 private:
  // Hidden: a pool is private to each shared object, so none of them
  // exports it (a default-visibility static of a template would be a GNU
  // unique symbol, which libkvferry.so's version script cannot hide).
  __attribute__((visibility("hidden"))) static std::vector<std::vector<T>>& Pool() {
    thread_local std::vector<std::vector<T>> pool;
    return pool;
  }
  std::vector<T> v_;
};

// SmallScratch<T, N>(n): n elements (value-initialized for a batch that
// spills), on the stack when n <= N, else in a Scratch<T>: a hot path
// whose usual call is small (a one-request batch) touches no pool.
template <typename T, size_t N>
class SmallScratch {
 public:
  explicit SmallScratch(size_t n) {
    if (n <= N) {
      span_ = absl::MakeSpan(stack_, n);
    } else {
      spill_.emplace()->resize(n);
      span_ = absl::MakeSpan(**spill_);
    }
  }
  SmallScratch(const SmallScratch&) = delete;
  SmallScratch& operator=(const SmallScratch&) = delete;

  absl::Span<T> span() const { return span_; }

 private:
  T stack_[N];
  std::optional<Scratch<T>> spill_;
  absl::Span<T> span_;
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_SCRATCH_H_
