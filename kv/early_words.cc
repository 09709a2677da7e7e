#include "kv/early_words.h"

#include <algorithm>
#include <utility>

namespace kvferry {
namespace kv_internal {

void EarlyWords::Keep(const std::string& id, EarlyWord word) {
  const size_t bytes = word.status.aux.size() + id.size();
  if (bytes > kMaxEarlyBytes) {
    ++dropped_;
    return;
  }
  while (!early_.empty() && (early_.size() >= kMaxEarlyWords || bytes_ + bytes > kMaxEarlyBytes)) {
    (void)Remove(early_.find(order_.begin()->second));
    ++dropped_;
  }
  Kept k{std::move(word), clock_->Now(), ++seq_};
  order_.emplace(k.seq, id);
  bytes_ += bytes;
  early_.emplace(id, std::move(k));
}

const EarlyWord* EarlyWords::Find(const std::string& id) const {
  auto it = early_.find(id);
  return it == early_.end() ? nullptr : &it->second.word;
}

std::optional<EarlyWord> EarlyWords::Take(const std::string& id) {
  auto it = early_.find(id);
  if (it == early_.end()) return std::nullopt;
  return Remove(it);
}

EarlyWord EarlyWords::Remove(std::map<std::string, Kept>::iterator it) {
  Kept k = std::move(it->second);
  bytes_ -= k.word.status.aux.size() + it->first.size();
  order_.erase(k.seq);
  early_.erase(it);
  return std::move(k.word);
}

void EarlyWords::Expire() {
  const absl::Time now = clock_->Now();
  while (!order_.empty()) {
    auto it = early_.find(order_.begin()->second);
    if (now - it->second.arrived < ttl_) return;
    (void)Remove(it);
    ++dropped_;
  }
}

void EarlyWords::Announce(const std::string& id, BegunWord word) {
  if (begun_.count(id) == 0 && begun_.size() >= kMaxEarlyWords) {
    auto oldest = std::min_element(begun_.begin(), begun_.end(), [](const auto& a, const auto& b) {
      return a.second.arrived < b.second.arrived;
    });
    begun_.erase(oldest);
    ++dropped_;
  }
  word.arrived = clock_->Now();
  begun_[id] = std::move(word);
}

std::optional<BegunWord> EarlyWords::TakeBegun(const std::string& id) {
  auto it = begun_.find(id);
  if (it == begun_.end()) return std::nullopt;
  BegunWord word = std::move(it->second);
  begun_.erase(it);
  if (clock_->Now() - word.arrived >= ttl_) return std::nullopt;
  return word;
}

void EarlyWords::Forget(const std::string& id) {
  begun_.erase(id);
  if (auto it = early_.find(id); it != early_.end()) (void)Remove(it);
}

}  // namespace kv_internal
}  // namespace kvferry
