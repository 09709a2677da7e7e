// A set that remembers the last `capacity` values inserted: inserting one
// more forgets the oldest. For what a peer can make grow (fenced engine
// instances, finished request attempts), so that memory stays bounded.
// Not thread-safe: guard it like any container.
#ifndef KVFERRY_BASE_RECENT_SET_H_
#define KVFERRY_BASE_RECENT_SET_H_

#include <cstddef>
#include <deque>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace kvferry {

template <typename T>
class RecentSet {
 public:
  explicit RecentSet(size_t capacity) : capacity_(capacity) {}

  // Adds `value` (a value already present keeps its age); false if present.
  bool Insert(const T& value) {
    if (!set_.insert(value).second) return false;
    order_.push_back(value);
    if (order_.size() > capacity_) {
      set_.erase(order_.front());
      order_.pop_front();
    }
    return true;
  }
  bool Contains(const T& value) const { return set_.contains(value); }
  size_t size() const { return set_.size(); }

 private:
  const size_t capacity_;
  absl::flat_hash_set<T> set_;
  std::deque<T> order_;  // oldest first
};

// The same as a map: the values of the last `capacity` keys inserted.
template <typename K, typename V>
class RecentMap {
 public:
  explicit RecentMap(size_t capacity) : capacity_(capacity) {}

  // The value of `key`, inserted (value-initialized) if absent, which
  // forgets the oldest key beyond the capacity.
  V& operator[](const K& key) {
    auto [it, fresh] = map_.try_emplace(key);
    if (fresh) {
      order_.push_back(key);
      if (order_.size() > capacity_) {
        const K oldest = order_.front();
        order_.pop_front();
        if (!(oldest == key)) {
          map_.erase(oldest);
          it = map_.find(key);  // erasing may move it
        }
      }
    }
    return it->second;
  }
  const V* Find(const K& key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second;
  }
  size_t size() const { return map_.size(); }

 private:
  const size_t capacity_;
  absl::flat_hash_map<K, V> map_;
  std::deque<K> order_;  // oldest first
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_RECENT_SET_H_
