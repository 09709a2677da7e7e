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
    : engine_(engine),
      pool_(std::move(pool)),
      options_(options),
      early_(std::make_unique<kv_internal::EarlyWords>(engine->clock(), options.early_word_ttl)) {}

KvReceiver::~KvReceiver() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
    watches_.Wake();
  }
  if (watcher_.joinable()) watcher_.join();
}

absl::Status KvReceiver::Expect(const std::string& request_id, const std::string& prefill,
                                uint64_t prefill_engine_id) {
  RETURN_IF_ERROR(CheckRequestId(request_id));
  absl::StatusOr<net::HostPort> hp = net::ParseHostPort(prefill);
  if (!hp.ok()) return Annotate(hp.status(), "KvReceiver::Expect");
  const std::string peer = hp->ToString();
  bool watched;  // requests from it are pending: its instance is known
  {
    MutexLock lock(&mu_);
    watched = prefills_.count(peer) != 0;
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
    absl::StatusOr<uint64_t> id = engine_->ProbePeer(peer, options_.peer_timeout / 4);
    if (id.ok()) instance = *id;
    probe_now = !id.ok() && net::ConnectionRefused(id.status());
  }
  // With real time, the watcher's first round for it is now as well: it
  // opens the prefill's watch connection at once (a kill right after
  // Expect is then seen at once too), off the caller's thread.
  probe_now = probe_now || engine_->clock() == RealClock();
  const absl::Time now = engine_->clock()->Now();
  const bool presented = instance != 0 && instance != prefill_engine_id;
  // A word that came first is confirmed with this prefill before it counts.
  const bool confirmed = ConfirmEarly(request_id, instance, peer);
  {
    MutexLock lock(&mu_);
    ClaimEarly(request_id, instance, /*expected=*/true, confirmed);
    (void)early_->TakeBegun(request_id);  // Expect names the prefill itself
    Status& s = requests_[request_id];
    // Its word came first (the prefill was quicker than this call): there
    // is nothing left to watch.
    if (s.state != State::kPending) return absl::OkStatus();
    if (auto again = expected_.find(request_id); again != expected_.end()) Unexpect(again);
    return ExpectFrom(
        request_id, peer,
        Prefill{instance, presented, now, probe_now ? now : now + options_.peer_timeout / 4},
        prefill_engine_id);
  }
}

absl::Status KvReceiver::ExpectFrom(const std::string& request_id, const std::string& peer,
                                    Prefill first, uint64_t named) {
  auto [known, fresh] = prefills_.try_emplace(peer, first);
  if (!fresh && named != 0 && known->second.engine_id == 0) known->second.engine_id = named;
  ++known->second.expected;
  expected_[request_id] = peer;
  changed_.SignalAll();
  watches_.Wake();
  absl::Status started = StartWatcher();
  if (!started.ok()) Unexpect(expected_.find(request_id));
  return started;
}

bool KvReceiver::ConfirmEarly(const std::string& request_id, uint64_t instance,
                              const std::string& peer) {
  std::optional<std::pair<uint64_t, uint64_t>> early;  // its sender and digest
  {
    MutexLock lock(&mu_);
    const kv_internal::EarlyWord* e = early_->Find(request_id);
    if (e != nullptr && !e->confirmed && (instance == 0 || e->engine_id == instance)) {
      early.emplace(e->engine_id, e->digest);
    }
  }
  if (!early.has_value()) return false;
  return engine_->ConfirmSent(peer, early->first, early->second, options_.peer_timeout / 4)
      .value_or(false);
}

KvReceiver::Status KvReceiver::Poll(const std::string& request_id) {
  MutexLock lock(&mu_);
  TakeWords();
  if (requests_.find(request_id) == requests_.end()) ClaimEarly(request_id, 0, false, false);
  auto it = requests_.find(request_id);
  if (it == requests_.end() && early_->Announced(request_id)) {
    requests_.try_emplace(request_id);  // a Poll asks for it: its prefill is watched
    Adopt(request_id);
    it = requests_.find(request_id);
  }
  return it == requests_.end() ? Status{} : it->second;
}

absl::StatusOr<KvReceiver::Status> KvReceiver::Wait(const std::string& request_id,
                                                    absl::Duration timeout) {
  // One waiting thread at a time takes notifications from the engine (in
  // short slices, so a failure found by the watcher is seen promptly); the
  // others wait for it to say something changed.
  constexpr absl::Duration kSlice = absl::Milliseconds(10);
  Clock* clock = engine_->clock();
  const bool simulated = clock != RealClock();
  const absl::Time deadline = clock->Now() + timeout;
  mu_.Lock();
  // A waiter expects the request: its words are kept from now on.
  ClaimEarly(request_id, 0, false, false);
  requests_.try_emplace(request_id);
  Adopt(request_id);
  for (;;) {
    TakeWords();
    auto it = requests_.find(request_id);
    if (it != requests_.end() && it->second.state != State::kPending) {
      Status s = it->second;
      mu_.Unlock();
      return s;
    }
    const absl::Duration left = deadline - clock->Now();
    if (left <= absl::ZeroDuration()) {
      mu_.Unlock();
      return absl::DeadlineExceededError(absl::StrCat(
          "KV request ", request_id, " still pending after ", absl::FormatDuration(timeout)));
    }
    if (pumping_) {
      changed_.WaitWithTimeout(&mu_, std::min(left, kSlice));
      continue;
    }
    pumping_ = true;
    mu_.Unlock();
    if (simulated) CheckPrefills();  // no watcher thread on simulated time
    absl::StatusOr<Notification> n = engine_->WaitNotification(std::min(left, kSlice), IsWord);
    std::vector<Vetted> words;
    if (n.ok()) words = Vet({std::move(*n)});
    mu_.Lock();
    pumping_ = false;
    Absorb(std::move(words));
    changed_.SignalAll();
  }
}

uint64_t KvReceiver::ignored_words() const {
  MutexLock lock(&mu_);
  return ignored_words_;
}

uint64_t KvReceiver::unconfirmed_words() const {
  MutexLock lock(&mu_);
  return unconfirmed_;
}

uint64_t KvReceiver::dropped_early_words() const {
  MutexLock lock(&mu_);
  return early_->dropped();
}

uint64_t KvReceiver::checksum_failures() const {
  MutexLock lock(&mu_);
  return checksum_failures_;
}

void KvReceiver::Forget(const std::string& request_id) {
  MutexLock lock(&mu_);
  requests_.erase(request_id);
  early_->Forget(request_id);  // forgotten by the application, not dropped
  if (auto t = tokens_.find(request_id); t != tokens_.end()) {
    // Its attempt's words are ignored from now on (the id may come again).
    retired_.Insert({request_id, t->second});
    tokens_.erase(t);
  }
  if (auto e = expected_.find(request_id); e != expected_.end()) Unexpect(e);
}

std::vector<Notification> KvReceiver::TakeOtherNotifications() {
  return engine_->TakeNotifications([](absl::string_view m) { return !IsWord(m); });
}

}  // namespace kvferry
