// KvReceiver, watching the prefills that expected requests come from:
// probes, watch connections, deaths and fences (kv/kv_cache.h).
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
#include "kv/kv_cache.h"
#include "kv/kv_receiver_internal.h"
#include "kv/kv_words.h"
#include "net/socket.h"

namespace kvferry {
namespace kv_internal {

PrefillWatcher::~PrefillWatcher() {
  {
    MutexLock lock(&s_.mu);
    s_.stopping = true;
    s_.changed.SignalAll();
    s_.watches.Wake();
  }
  if (thread_.joinable()) thread_.join();
}

absl::Status PrefillWatcher::ExpectFrom(ReceiverState& s, const std::string& request_id,
                                        const std::string& peer, PrefillState first,
                                        uint64_t named) {
  auto [known, fresh] = s.prefills.try_emplace(peer, first);
  if (!fresh && named != 0 && known->second.engine_id == 0) known->second.engine_id = named;
  ++known->second.expected;
  s.expected[request_id] = peer;
  s.changed.SignalAll();
  s.watches.Wake();
  absl::Status started = Start(s);
  if (!started.ok()) Unexpect(s, s.expected.find(request_id));
  return started;
}

void PrefillWatcher::Loop() {
  s_.mu.Lock();
  while (!s_.stopping) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [peer, p] : s_.prefills) next = std::min(next, p.next_probe);
    const absl::Duration wait = next - absl::Now();
    if (wait > absl::ZeroDuration()) {
      // A closed watch makes its prefill due now.
      const std::vector<std::string> ended =
          s_.watches.Wait(&s_.mu, &s_.changed, std::min(wait, absl::Hours(1)));
      const absl::Time now = absl::Now();
      for (const std::string& peer : ended) {
        auto p = s_.prefills.find(peer);
        if (p == s_.prefills.end()) continue;
        p->second.next_probe = now;
        p->second.quick_retries = kQuickRetries;
      }
      continue;
    }
    s_.mu.Unlock();
    CheckPrefills();
    s_.mu.Lock();
  }
  s_.mu.Unlock();
}

void PrefillWatcher::CheckPrefills() {
  // The due prefills, their states and whether each is watched, in one
  // look under the lock; probed and judged outside it.
  std::vector<std::string> peers;
  std::vector<PrefillState> states;
  std::vector<bool> watched;
  {
    MutexLock lock(&s_.mu);
    const absl::Time now = s_.engine->clock()->Now();
    for (const auto& [peer, p] : s_.prefills) {
      if (p.next_probe > now) continue;
      peers.push_back(peer);
      states.push_back(p);
      watched.push_back(s_.watches.Has(peer));
    }
  }
  if (peers.empty()) return;
  std::vector<Probe> probes = ProbeAll(*s_.engine, peers, watched, s_.peer_timeout / 4);
  for (size_t i = 0; i < peers.size(); ++i) Judge(peers[i], states[i], probes[i]);
}

void PrefillWatcher::Judge(const std::string& peer, const PrefillState& p, Probe& probe) {
  const absl::Duration period = s_.peer_timeout / 4;
  const absl::StatusOr<uint64_t>& id = probe.id;
  // Silent handshake, busy data links: alive (its probes may be starved
  // or lost; its writes are not). Only for an instance that presented
  // itself: links claiming a merely named id prove nothing.
  const uint64_t inputs = p.presented ? s_.engine->DataInputsFrom(p.engine_id) : 0;
  const bool data_moved = inputs > p.inputs;
  const absl::Status dead = DeathOf(peer, p, id, probe.end, data_moved, s_.peer_timeout);
  // Fenced before anyone is told: nothing of it lands afterwards. Only an
  // id the prefill presented itself: never one a caller merely named.
  if (!dead.ok() && p.engine_id != 0 && p.presented) {
    s_.engine->FencePeer(p.engine_id, dead.message());
  }
  MutexLock lock(&s_.mu);
  auto it = s_.prefills.find(peer);
  if (it == s_.prefills.end()) return;
  if (!dead.ok()) {
    FailFrom(s_, peer, dead);  // forgets the prefill with its last request
    return;
  }
  PrefillState& now = it->second;
  if (id.ok()) {
    now.engine_id = *id;
    now.presented = true;
  }
  if (probe.watch.valid()) s_.watches.Add(peer, std::move(probe.watch));  // polled from now on
  // An answer, even a refusal (an overloaded or fencing engine), means its
  // process is alive.
  const bool answered = id.ok() || TransferEngine::PeerAnswered(id.status());
  if (answered || data_moved) now.last_answer = probe.end;
  now.inputs = std::max(now.inputs, inputs);
  now.next_probe = probe.start + period;
  if (answered) {
    now.quick_retries = 0;
  } else if (now.quick_retries > 0) {
    --now.quick_retries;
    now.next_probe = std::min(now.next_probe, probe.end + kQuickRetry);
  }
}

void PrefillWatcher::FailFrom(ReceiverState& s, const std::string& prefill,
                              const absl::Status& why) {
  // Words still in the engine's inbox are not taken: the prefill, gone,
  // cannot confirm them (they stay there for the next Poll or Wait, and
  // find their requests failed).
  for (auto it = s.expected.begin(); it != s.expected.end();) {
    if (it->second != prefill) {
      ++it;
      continue;
    }
    KvRequestStatus& r = s.requests[it->first];
    if (r.state == KvRequestState::kPending) {
      r.state = KvRequestState::kFailed;
      r.error = why;
    }
    Unexpect(s, it++);
  }
  s.changed.SignalAll();
}

void PrefillWatcher::Unexpect(ReceiverState& s, Expectation e) {
  auto p = s.prefills.find(e->second);
  if (p != s.prefills.end() && --p->second.expected == 0) {
    s.watches.Remove(p->first);
    s.prefills.erase(p);
  }
  s.expected.erase(e);
}

absl::Status PrefillWatcher::Start(ReceiverState& s) {
  if (s.watcher_started || s.engine->clock() != RealClock()) return absl::OkStatus();
  absl::StatusOr<std::thread> t =
      StartThread("a KV receiver's prefill watcher", [this] { Loop(); });
  if (!t.ok()) return t.status();
  s.watcher_started = true;
  thread_ = std::move(*t);
  return absl::OkStatus();
}

}  // namespace kv_internal
}  // namespace kvferry
