// What peers tell this engine outside the data path: the inbox of
// notifications they sent, and the metadata this engine publishes for them
// to fetch. Each owns its state and its lock.
#ifndef KVFERRY_ENGINE_PEER_NOTIFICATIONS_H_
#define KVFERRY_ENGINE_PEER_NOTIFICATIONS_H_

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/recent_set.h"
#include "engine/types.h"

namespace kvferry {
namespace engine_internal {

// Blocks until ready() or the timeout (EngineParts::wait).
using WaitFunction =
    std::function<bool(const std::function<bool()>& ready, absl::Duration timeout)>;

// Bounded: a peer cannot grow it without limit while the application does
// not take what arrives.
inline constexpr size_t kMaxInboxNotifications = 65536;
inline constexpr size_t kMaxInboxBytes = 64 << 20;

class Inbox {
 public:
  // `wait` empty: real time on a condition variable.
  explicit Inbox(WaitFunction wait, size_t max_count = kMaxInboxNotifications,
                 size_t max_bytes = kMaxInboxBytes)
      : wait_(std::move(wait)), max_count_(max_count), max_bytes_(max_bytes) {}
  // kResourceExhausted when the inbox holds max_count notifications or this
  // one would take it past max_bytes (the sender is told).
  absl::Status Push(Notification n) ABSL_LOCKS_EXCLUDED(mu_);
  // Which notifications a taker wants (null: every one).
  using Filter = std::function<bool(absl::string_view message)>;
  // Every notification so far that `which` wants, oldest first; removed
  // from the inbox (the others stay, in order).
  std::vector<Notification> TakeAll(const Filter& which = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The oldest notification `which` wants, waiting up to `timeout` for one.
  absl::StatusOr<Notification> Next(absl::Duration timeout, const Filter& which = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The first notification `which` wants, or queue_.end().
  std::deque<Notification>::iterator Find(const Filter& which) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WaitFunction wait_;
  const size_t max_count_, max_bytes_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Notification> queue_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// A digest of a notification's bytes (SHA-256, its first 8 bytes): what a
// receiver asks the sender about (kConfirm). Both ends compute it alike.
uint64_t NotificationDigest(absl::string_view message);

// The notifications this engine sent lately, as digests: what it confirms
// to receivers that ask. Bounded: the oldest of more than kMaxSent are
// forgotten (a receiver asks within a round trip of receiving one).
class SentLog {
 public:
  static constexpr size_t kMaxSent = 1 << 16;
  void Add(uint64_t digest) ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(uint64_t digest) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  RecentSet<uint64_t> sent_ ABSL_GUARDED_BY(mu_){kMaxSent};
};

class MetadataStore {
 public:
  // kInvalidArgument for an empty or oversized key or value.
  absl::Status Publish(const std::string& key, std::string value) ABSL_LOCKS_EXCLUDED(mu_);
  // kNotFound when nothing was published under `key`.
  absl::StatusOr<std::string> Get(const std::string& key) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PEER_NOTIFICATIONS_H_
