// Scratch<T>: a std::vector<T> borrowed from a per-thread pool and given
// back (emptied, capacity kept) when the Scratch goes out of scope. Hot
// paths use it for temporary lists so that, once warm, they allocate
// nothing; nesting (a hot path calling another) takes a second vector.
#ifndef KVFERRY_BASE_SCRATCH_H_
#define KVFERRY_BASE_SCRATCH_H_

#include <utility>
#include <vector>

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
  static std::vector<std::vector<T>>& Pool() {
    thread_local std::vector<std::vector<T>> pool;
    return pool;
  }
  std::vector<T> v_;
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_SCRATCH_H_
