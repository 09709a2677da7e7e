#include "engine/peer/notifications.h"

#include <openssl/sha.h>

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "handshake/messages.h"

namespace kvferry {
namespace engine_internal {

absl::Status Inbox::Push(Notification n) {
  MutexLock lock(&mu_);
  if (queue_.size() >= max_count_ || bytes_ + n.message.size() > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("the peer's inbox is full (", queue_.size(),
                                                     " notifications, ", bytes_,
                                                     " bytes not yet taken by its application)"));
  }
  bytes_ += n.message.size();
  queue_.push_back(std::move(n));
  cv_.SignalAll();
  return absl::OkStatus();
}

std::deque<Notification>::iterator Inbox::Find(const Filter& which) {
  if (!which) return queue_.begin();
  return std::find_if(queue_.begin(), queue_.end(),
                      [&](const Notification& n) { return which(n.message); });
}

std::vector<Notification> Inbox::TakeAll(const Filter& which) {
  MutexLock lock(&mu_);
  std::vector<Notification> out;
  std::deque<Notification> kept;
  for (Notification& n : queue_) {
    if (which && !which(n.message)) {
      kept.push_back(std::move(n));
      continue;
    }
    bytes_ -= n.message.size();
    out.push_back(std::move(n));
  }
  queue_.swap(kept);
  return out;
}

absl::StatusOr<Notification> Inbox::Next(absl::Duration timeout, const Filter& which) {
  if (wait_) {
    wait_(
        [&] {
          MutexLock lock(&mu_);
          return Find(which) != queue_.end();
        },
        timeout);
  }
  MutexLock lock(&mu_);
  if (!wait_) {
    cv_.AwaitWithDeadline(&mu_, absl::Now() + timeout, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return Find(which) != queue_.end();
    });
  }
  auto it = Find(which);
  if (it == queue_.end()) {
    return absl::DeadlineExceededError(
        absl::StrCat("no notification within ", absl::FormatDuration(timeout)));
  }
  Notification n = std::move(*it);
  queue_.erase(it);
  bytes_ -= n.message.size();
  return n;
}

absl::Status MetadataStore::Publish(const std::string& key, std::string value) {
  if (key.empty() || key.size() > handshake::kMaxStringBytes ||
      value.size() > handshake::kMaxNotifyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key must be 1 to ", handshake::kMaxStringBytes,
                     " bytes and the value at most ", handshake::kMaxNotifyBytes));
  }
  MutexLock lock(&mu_);
  values_[key] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> MetadataStore::Get(const std::string& key) const {
  MutexLock lock(&mu_);
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::NotFoundError(absl::StrCat("the peer has published no '", key, "'"));
  }
  return it->second;
}

uint64_t NotificationDigest(absl::string_view message) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(message.data()), message.size(), d);
  uint64_t out = 0;
  for (int i = 0; i < 8; ++i) out |= uint64_t{d[i]} << (8 * i);
  return out;
}

void SentLog::Add(uint64_t digest) {
  MutexLock lock(&mu_);
  sent_.Insert(digest);
}

bool SentLog::Contains(uint64_t digest) const {
  MutexLock lock(&mu_);
  return sent_.Contains(digest);
}

}  // namespace engine_internal
}  // namespace kvferry
