// KvReceiver: the decode side of the KV layer (engine/kv_cache.h).

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "kv/early_words.h"
#include "kv/kv_cache.h"
#include "kv/kv_words.h"
#include "net/socket.h"

namespace kvferry {

using kv_internal::CheckRequestId;
using kv_internal::kReadsBeginWords;
using kv_internal::ParseWord;
bool KvReceiver::IsWord(absl::string_view message) { return ParseWord(message).has_value(); }

// ---------------------------------------------------------------- receiver

absl::StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::Create(TransferEngine* engine, KvPool pool,
                                                               Options options) {
  if (!(options.peer_timeout > absl::ZeroDuration()) ||
      options.peer_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("KvReceiver: peer_timeout must be positive and finite");
  }
  if (!(options.early_word_ttl > absl::ZeroDuration())) {
    return absl::InvalidArgumentError("KvReceiver: early_word_ttl must be positive");
  }
  RETURN_IF_ERROR(pool.Register(*engine, transport::Access::kRemoteWrite));
  std::vector<std::string> addrs;
  for (uint32_t b = 0; b < pool.layout().buffer_count(); ++b) {
    addrs.push_back(absl::StrFormat("%x", reinterpret_cast<uintptr_t>(pool.buffer(b))));
  }
  RETURN_IF_ERROR(engine->PublishMetadata(
      kKvPoolMetadataKey, absl::StrCat(pool.layout().Encode(), "\n", absl::StrJoin(addrs, ","),
                                       "\n", kReadsBeginWords)));
  return std::unique_ptr<KvReceiver>(new KvReceiver(engine, std::move(pool), options));
}

KvReceiver::KvReceiver(TransferEngine* engine, KvPool pool, Options options)
    : pool_(std::move(pool)),
      state_(engine, &pool_, options.peer_timeout, options.early_word_ttl) {}

KvReceiver::~KvReceiver() = default;  // the watcher stops and joins its thread

absl::Status KvReceiver::Expect(const std::string& request_id, const std::string& prefill,
                                uint64_t prefill_engine_id) {
  RETURN_IF_ERROR(CheckRequestId(request_id));
  absl::StatusOr<net::HostPort> hp = net::ParseHostPort(prefill);
  if (!hp.ok()) return Annotate(hp.status(), "KvReceiver::Expect");
  const std::string peer = hp->ToString();
  bool watched;  // requests from it are pending: its instance is known
  {
    MutexLock lock(&state_.mu);
    watched = state_.prefills.count(peer) != 0;
  }
  // A prefill not being watched is asked who it is now (one round trip),
  // unless the caller named the instance, so that a restart later is told
  // from a living instance.
  uint64_t instance = prefill_engine_id;
  // Its first probe is due now when nothing answered for it yet: an id the
  // caller named is checked at once, and a port that refused is a prefill
  // gone (reported without waiting).
  bool probe_now = prefill_engine_id != 0;
  if (!watched && instance == 0) {
    absl::StatusOr<uint64_t> id = state_.engine->ProbePeer(peer, state_.peer_timeout / 4);
    if (id.ok()) instance = *id;
    probe_now = !id.ok() && net::ConnectionRefused(id.status());
  }
  // With real time, the watcher's first round for it is now as well: it
  // opens the prefill's watch connection at once (a kill right after
  // Expect is then seen at once too), off the caller's thread.
  probe_now = probe_now || state_.engine->clock() == RealClock();
  const absl::Time now = state_.engine->clock()->Now();
  const bool presented = instance != 0 && instance != prefill_engine_id;
  // A word that came first is confirmed with this prefill before it counts.
  const bool confirmed = words_.ConfirmEarly(request_id, instance, peer);
  {
    MutexLock lock(&state_.mu);
    words_.ClaimEarly(state_, request_id, instance, /*expected=*/true, confirmed);
    (void)state_.early.TakeBegun(request_id);  // Expect names the prefill itself
    Status& s = state_.requests[request_id];
    // Its word came first (the prefill was quicker than this call): there
    // is nothing left to watch.
    if (s.state != State::kPending) return absl::OkStatus();
    if (auto again = state_.expected.find(request_id); again != state_.expected.end())
      watcher_.Unexpect(state_, again);
    return watcher_.ExpectFrom(
        state_, request_id, peer,
        kv_internal::PrefillState{instance, presented, now,
                                  probe_now ? now : now + state_.peer_timeout / 4},
        prefill_engine_id);
  }
}

KvReceiver::Status KvReceiver::Poll(const std::string& request_id) {
  MutexLock lock(&state_.mu);
  words_.TakeWords(state_);
  if (state_.requests.find(request_id) == state_.requests.end())
    words_.ClaimEarly(state_, request_id, 0, false, false);
  auto it = state_.requests.find(request_id);
  if (it == state_.requests.end() && state_.early.Announced(request_id)) {
    state_.requests.try_emplace(request_id);  // a Poll asks for it: its prefill is watched
    words_.Adopt(state_, request_id);
    it = state_.requests.find(request_id);
  }
  return it == state_.requests.end() ? Status{} : it->second;
}

absl::StatusOr<KvReceiver::Status> KvReceiver::Wait(const std::string& request_id,
                                                    absl::Duration timeout) {
  // One waiting thread at a time takes notifications from the engine (in
  // short slices, so a failure found by the watcher is seen promptly); the
  // others wait for it to say something changed.
  constexpr absl::Duration kSlice = absl::Milliseconds(10);
  Clock* clock = state_.engine->clock();
  const bool simulated = clock != RealClock();
  const absl::Time deadline = clock->Now() + timeout;
  state_.mu.Lock();
  // A waiter expects the request: its words are kept from now on.
  words_.ClaimEarly(state_, request_id, 0, false, false);
  state_.requests.try_emplace(request_id);
  words_.Adopt(state_, request_id);
  for (;;) {
    words_.TakeWords(state_);
    auto it = state_.requests.find(request_id);
    if (it != state_.requests.end() && it->second.state != State::kPending) {
      Status s = it->second;
      state_.mu.Unlock();
      return s;
    }
    const absl::Duration left = deadline - clock->Now();
    if (left <= absl::ZeroDuration()) {
      state_.mu.Unlock();
      return absl::DeadlineExceededError(absl::StrCat(
          "KV request ", request_id, " still pending after ", absl::FormatDuration(timeout)));
    }
    if (state_.pumping) {
      state_.changed.WaitWithTimeout(&state_.mu, std::min(left, kSlice));
      continue;
    }
    state_.pumping = true;
    state_.mu.Unlock();
    if (simulated) watcher_.CheckPrefills();  // no watcher thread on simulated time
    absl::StatusOr<Notification> n =
        state_.engine->WaitNotification(std::min(left, kSlice), IsWord);
    std::vector<kv_internal::Vetted> words;
    if (n.ok()) words = words_.Vet({std::move(*n)});
    state_.mu.Lock();
    state_.pumping = false;
    words_.Absorb(state_, std::move(words));
    state_.changed.SignalAll();
  }
}

uint64_t KvReceiver::ignored_words() const {
  MutexLock lock(&state_.mu);
  return state_.ignored_words;
}

uint64_t KvReceiver::unconfirmed_words() const {
  MutexLock lock(&state_.mu);
  return state_.unconfirmed;
}

uint64_t KvReceiver::dropped_early_words() const {
  MutexLock lock(&state_.mu);
  return state_.early.dropped();
}

uint64_t KvReceiver::checksum_failures() const {
  MutexLock lock(&state_.mu);
  return state_.checksum_failures;
}

void KvReceiver::Forget(const std::string& request_id) {
  MutexLock lock(&state_.mu);
  state_.requests.erase(request_id);
  state_.early.Forget(request_id);  // forgotten by the application, not dropped
  if (auto t = state_.tokens.find(request_id); t != state_.tokens.end()) {
    // Its attempt's words are ignored from now on (the id may come again).
    state_.retired.Insert({request_id, t->second});
    state_.tokens.erase(t);
  }
  if (auto e = state_.expected.find(request_id); e != state_.expected.end())
    watcher_.Unexpect(state_, e);
}

std::vector<Notification> KvReceiver::TakeOtherNotifications() {
  return state_.engine->TakeNotifications([](absl::string_view m) { return !IsWord(m); });
}

}  // namespace kvferry
