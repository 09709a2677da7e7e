// KvReceiver's units and the state they share (kv/kv_cache.h holds the
// class itself):
//   ReceiverState   the requests, their expectations, the prefills they
//                   come from, early words and counters, under one lock;
//   PrefillWatcher  expectations, and the thread that probes and watches
//                   the prefills and fails the requests of a dead one
//                   (kv_receiver_watch.cc);
//   WordTaker       the KV words taken from the engine: vetted with their
//                   senders, and what each resolves (kv_receiver_words.cc).
// KvReceiver (kv_receiver.cc) is the facade: Expect, Poll, Wait, Forget.
// Internal to //kv:kv.
#ifndef KVFERRY_KV_KV_RECEIVER_INTERNAL_H_
#define KVFERRY_KV_KV_RECEIVER_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/recent_set.h"
#include "engine/transfer_engine.h"
#include "kv/early_words.h"
#include "kv/kv_request.h"
#include "kv/prefill_probe.h"
#include "kv/watch_set.h"

namespace kvferry {

class KvPool;

namespace kv_internal {

struct Word;  // kv/kv_words.h

// The receiver's state. Its lock (mu) is the only one the units take.
struct ReceiverState {
  ReceiverState(TransferEngine* e, const KvPool* p, absl::Duration timeout, absl::Duration ttl)
      : engine(e), pool(p), peer_timeout(timeout), early(e->clock(), ttl) {}

  TransferEngine* const engine;
  const KvPool* const pool;           // the receiver's
  const absl::Duration peer_timeout;  // KvReceiver::Options

  mutable Mutex mu;
  CondVar changed;                           // a request finished, or Expect/stop
  bool pumping ABSL_GUARDED_BY(mu) = false;  // a Wait is in WaitNotification
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool watcher_started ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, KvRequestStatus> requests ABSL_GUARDED_BY(mu);
  std::map<std::string, std::string> expected ABSL_GUARDED_BY(mu);  // request -> prefill
  // The prefills pending expected requests come from, and nothing else.
  std::map<std::string, PrefillState> prefills ABSL_GUARDED_BY(mu);
  uint64_t checksum_failures ABSL_GUARDED_BY(mu) = 0;
  uint64_t ignored_words ABSL_GUARDED_BY(mu) = 0;
  uint64_t unconfirmed ABSL_GUARDED_BY(mu) = 0;
  // Early and begin words (kv/early_words.h).
  EarlyWords early ABSL_GUARDED_BY(mu);
  // Words about expected requests whose prefill could not be asked yet.
  std::vector<Notification> unasked ABSL_GUARDED_BY(mu);
  // The attempt whose word finished each request, and the attempts of
  // requests forgotten since (their words are ignored; the oldest of more
  // than kMaxRetired are forgotten in turn).
  static constexpr size_t kMaxRetired = 65536;
  std::map<std::string, uint64_t> tokens ABSL_GUARDED_BY(mu);
  RecentSet<std::pair<std::string, uint64_t>> retired ABSL_GUARDED_BY(mu){kMaxRetired};
  // The watcher's wake-up and its watch connections (kv/watch_set.h).
  WatchSet watches ABSL_GUARDED_BY(mu);
};

using Expectation = std::map<std::string, std::string>::iterator;  // into ReceiverState::expected

// Expected requests and the prefills they come from: each such prefill is
// probed every quarter of peer_timeout, and watched over a connection of
// its own, by a thread (real time) or from Wait (simulated time). A dead
// one is fenced, then its requests fail.
// Its methods and WordTaker's that need the receiver's lock held take the
// state as their first argument (the lock is named through it).
class PrefillWatcher {
 public:
  explicit PrefillWatcher(ReceiverState& s) : s_(s) {}
  // Stops and joins the thread.
  ~PrefillWatcher();

  // Expects `request_id` from the prefill at `peer`: its entry is `first`
  // if it is new, else it takes the `named` instance if none is known yet;
  // the watcher runs from then on (its start failing undoes this).
  absl::Status ExpectFrom(ReceiverState& s, const std::string& request_id, const std::string& peer,
                          PrefillState first, uint64_t named) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Stops expecting `e`'s request; its prefill is forgotten with the last.
  void Unexpect(ReceiverState& s, Expectation e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Probes the prefills that are due, at once (at most kMaxProbesAtOnce at
  // a time); fences and fails those that are dead.
  void CheckPrefills() ABSL_LOCKS_EXCLUDED(s_.mu);

 private:
  // Starts the watcher thread if it is not running (real time only).
  absl::Status Start(ReceiverState& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Loop() ABSL_LOCKS_EXCLUDED(s_.mu);
  // What `probe` says of the prefill `p` at `peer`: dead (fenced, its
  // requests failed) or alive (its next probe planned, its watch kept).
  void Judge(const std::string& peer, const PrefillState& p, Probe& probe)
      ABSL_LOCKS_EXCLUDED(s_.mu);
  void FailFrom(ReceiverState& s, const std::string& prefill, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  ReceiverState& s_;
  std::thread thread_;  // with the real clock; simulations check from Wait
};

// A word taken from the engine, and whether the engine it names, asked
// at the address its request is expected from, said it sent it
// (TransferEngine::ConfirmSent). Only a confirmed word fails, completes
// or aborts an expected request; a word nobody expects yet is kept
// unconfirmed, and confirmed when an Expect names its prefill.
struct Vetted {
  Notification n;
  bool confirmed = false;
  bool unasked = false;  // its prefill could not be asked (no answer): try again later
};

// The KV words: taken from the engine's inbox, vetted with their senders,
// and applied to the requests (or kept early, bounded, for an Expect, Poll
// or Wait to come).
class WordTaker {
 public:
  WordTaker(ReceiverState& s, PrefillWatcher& watcher) : s_(s), watcher_(watcher) {}

  // Confirms the words about expected requests (a round trip to their
  // prefills each; none while holding the lock).
  std::vector<Vetted> Vet(std::vector<Notification> notes) ABSL_LOCKS_EXCLUDED(s_.mu);
  // Vet(what the engine holds for this receiver), then Absorb; the lock
  // held on entry and exit, released while vetting.
  void TakeWords(ReceiverState& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Absorb(ReceiverState& s, std::vector<Vetted> words) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Moves `id`'s early word, if any, to the requests: for an Expect
  // (`expected`), only one from `instance` (when known) that was confirmed
  // (at arrival, or by the caller: `confirmed`); for a Poll or Wait without
  // an Expect, any (nothing names its prefill to ask).
  void ClaimEarly(ReceiverState& s, const std::string& id, uint64_t instance, bool expected,
                  bool confirmed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Whether the prefill at `peer` confirms it sent the early word about
  // `request_id` (from `instance`, when known), if one is kept unconfirmed.
  bool ConfirmEarly(const std::string& request_id, uint64_t instance, const std::string& peer)
      ABSL_LOCKS_EXCLUDED(s_.mu);
  // Expects `id` from the prefill a begn word named, if one did and
  // nothing expects the request yet (an Expect's binding without a call).
  void Adopt(ReceiverState& s, const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

 private:
  // A word about the expected request `e`: true when it counts (confirmed,
  // from the instance expected; the request is no longer expected then),
  // false when it is ignored, counted as forged, or kept to ask again.
  bool TakeExpected(ReceiverState& s, Vetted& v, Expectation e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // A prefill's word that it began a request nobody expects (Expect) yet,
  // confirmed by the engine at the address it names: a Poll or Wait
  // without Expect watches that prefill from then on (Adopt).
  // "begn": kept (bounded as early words are); true when a Poll or Wait
  // asks for the request already (the caller adopts it then).
  bool Announced(ReceiverState& s, const std::string& id, const Vetted& v,
                 absl::string_view prefill) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // What a word says about its request (checksums verified; the sender's
  // links dropped for an aborted one).
  // An abort drops the sender's links first: all of them when it confirmed
  // the word, else only those asked for from where the word came from (a
  // forger on another host cannot cut an innocent engine's links).
  KvRequestStatus Resolve(ReceiverState& s, const std::string& id, const Word& w, uint64_t from,
                          absl::string_view source, bool confirmed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // A completion with checksums: the aux payload, or why the pages differ.
  absl::StatusOr<std::string> Verify(ReceiverState& s, const std::string& request_id,
                                     absl::string_view body) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  ReceiverState& s_;
  PrefillWatcher& watcher_;
};

}  // namespace kv_internal
}  // namespace kvferry

#endif  // KVFERRY_KV_KV_RECEIVER_INTERNAL_H_
