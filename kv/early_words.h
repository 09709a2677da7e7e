// The words a KvReceiver keeps before anyone asks for their request: a
// finished request's word that came before the decode's Expect, Poll or
// Wait (its prefill was quicker, or the word is forged), and a prefill's
// begin word naming where it runs. Both kinds are bounded in number
// (KvReceiver::kMaxEarlyWords each) and age (early_word_ttl), and early
// words in bytes (kMaxEarlyBytes); past a bound the oldest go first, counted
// as dropped.
//
// Not thread-safe: the receiver holds it under its own lock. What a word
// means, and whether it counts, is the receiver's business
// (kv_receiver_words.cc); this only keeps them.
#ifndef KVFERRY_KV_EARLY_WORDS_H_
#define KVFERRY_KV_EARLY_WORDS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "base/clock.h"
#include "kv/kv_request.h"

namespace kvferry {
namespace kv_internal {

// The bounds (KvReceiver::kMaxEarlyWords, kMaxEarlyBytes).
constexpr size_t kMaxEarlyWords = 4096;
constexpr size_t kMaxEarlyBytes = 4 << 20;

// A word that came before anyone expected its request.
struct EarlyWord {
  KvRequestStatus status;
  uint64_t engine_id = 0;  // its sender, as it claims
  uint64_t token = 0;
  uint64_t digest = 0;  // TransferEngine::NotificationDigest, to confirm it later
  bool confirmed = false;
  std::string source;  // where it came from (Notification::source)
};

// A prefill's word that it began a request, confirmed by the engine at the
// address it names.
struct BegunWord {
  std::string prefill;  // its handshake address
  uint64_t engine_id = 0;
  absl::Time arrived;
};

class EarlyWords {
 public:
  // `clock` outlives this; words older than `ttl` are dropped.
  EarlyWords(Clock* clock, absl::Duration ttl) : clock_(clock), ttl_(ttl) {}

  // Keeps `word` about request `id` (the caller checked there is none yet),
  // dropping the oldest to stay within the bounds; a word larger than them
  // alone is dropped.
  void Keep(const std::string& id, EarlyWord word);
  // The early word about `id`, or null.
  const EarlyWord* Find(const std::string& id) const;
  // Removes and returns the early word about `id`, if any (not a drop).
  std::optional<EarlyWord> Take(const std::string& id);
  // Drops early words older than the ttl.
  void Expire();

  // Keeps the begin word about `id` (replacing one before it).
  void Announce(const std::string& id, BegunWord word);
  bool Announced(const std::string& id) const { return begun_.count(id) != 0; }
  // Removes and returns the begin word about `id`, if any and younger than
  // the ttl.
  std::optional<BegunWord> TakeBegun(const std::string& id);

  // Removes both kinds of word about `id` (not a drop).
  void Forget(const std::string& id);
  // Counts a word the receiver dropped itself, against the same bound.
  void CountDrop() { ++dropped_; }
  // Words dropped unclaimed so far (too old, or pushed out by newer ones).
  uint64_t dropped() const { return dropped_; }

 private:
  struct Kept {
    EarlyWord word;
    absl::Time arrived;
    uint64_t seq = 0;  // its place in order_
  };
  // Removes `it` (and its share of the bounds).
  EarlyWord Remove(std::map<std::string, Kept>::iterator it);

  Clock* const clock_;
  const absl::Duration ttl_;
  std::map<std::string, Kept> early_;
  std::map<uint64_t, std::string> order_;  // seq -> id, oldest first
  uint64_t seq_ = 0;
  size_t bytes_ = 0;
  std::map<std::string, BegunWord> begun_;
  uint64_t dropped_ = 0;
};

}  // namespace kv_internal
}  // namespace kvferry

#endif  // KVFERRY_KV_EARLY_WORDS_H_
