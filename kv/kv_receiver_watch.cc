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
#include "kv/kv_words.h"
#include "net/socket.h"

namespace kvferry {

void KvReceiver::Watch() {
  mu_.Lock();
  while (!stopping_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [peer, p] : prefills_) next = std::min(next, p.next_probe);
    const absl::Duration wait = next - absl::Now();
    if (wait > absl::ZeroDuration()) {
      // A closed watch makes its prefill due now.
      const std::vector<std::string> ended =
          watches_.Wait(&mu_, &changed_, std::min(wait, absl::Hours(1)));
      const absl::Time now = absl::Now();
      for (const std::string& peer : ended) {
        auto p = prefills_.find(peer);
        if (p == prefills_.end()) continue;
        p->second.next_probe = now;
        p->second.quick_retries = kv_internal::kQuickRetries;
      }
      continue;
    }
    mu_.Unlock();
    CheckPrefills();
    mu_.Lock();
  }
  mu_.Unlock();
}

void KvReceiver::CheckPrefills() {
  // The due prefills, their states and whether each is watched, in one
  // look under the lock; probed and judged outside it.
  std::vector<std::string> peers;
  std::vector<Prefill> states;
  std::vector<bool> watched;
  {
    MutexLock lock(&mu_);
    const absl::Time now = engine_->clock()->Now();
    for (const auto& [peer, p] : prefills_) {
      if (p.next_probe > now) continue;
      peers.push_back(peer);
      states.push_back(p);
      watched.push_back(watches_.Has(peer));
    }
  }
  if (peers.empty()) return;
  std::vector<kv_internal::Probe> probes =
      kv_internal::ProbeAll(*engine_, peers, watched, options_.peer_timeout / 4);
  for (size_t i = 0; i < peers.size(); ++i) Judge(peers[i], states[i], probes[i]);
}

void KvReceiver::Judge(const std::string& peer, const Prefill& p, kv_internal::Probe& probe) {
  const absl::Duration period = options_.peer_timeout / 4;
  const absl::StatusOr<uint64_t>& id = probe.id;
  // Silent handshake, busy data links: alive (its probes may be starved
  // or lost; its writes are not). Only for an instance that presented
  // itself: links claiming a merely named id prove nothing.
  const uint64_t inputs = p.presented ? engine_->DataInputsFrom(p.engine_id) : 0;
  const bool data_moved = inputs > p.inputs;
  const absl::Status dead =
      kv_internal::DeathOf(peer, p, id, probe.end, data_moved, options_.peer_timeout);
  // Fenced before anyone is told: nothing of it lands afterwards. Only an
  // id the prefill presented itself: never one a caller merely named.
  if (!dead.ok() && p.engine_id != 0 && p.presented) {
    engine_->FencePeer(p.engine_id, dead.message());
  }
  MutexLock lock(&mu_);
  auto it = prefills_.find(peer);
  if (it == prefills_.end()) return;
  if (!dead.ok()) {
    FailFrom(peer, dead);  // forgets the prefill with its last request
    return;
  }
  Prefill& now = it->second;
  if (id.ok()) {
    now.engine_id = *id;
    now.presented = true;
  }
  if (probe.watch.valid()) watches_.Add(peer, std::move(probe.watch));  // polled from now on
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
    now.next_probe = std::min(now.next_probe, probe.end + kv_internal::kQuickRetry);
  }
}

void KvReceiver::FailFrom(const std::string& prefill, const absl::Status& why) {
  // Words still in the engine's inbox are not taken: the prefill, gone,
  // cannot confirm them (they stay there for the next Poll or Wait, and
  // find their requests failed).
  for (auto it = expected_.begin(); it != expected_.end();) {
    if (it->second != prefill) {
      ++it;
      continue;
    }
    Status& s = requests_[it->first];
    if (s.state == State::kPending) {
      s.state = State::kFailed;
      s.error = why;
    }
    Unexpect(it++);
  }
  changed_.SignalAll();
}

void KvReceiver::Unexpect(std::map<std::string, std::string>::iterator e) {
  auto p = prefills_.find(e->second);
  if (p != prefills_.end() && --p->second.expected == 0) {
    watches_.Remove(p->first);
    prefills_.erase(p);
  }
  expected_.erase(e);
}

absl::Status KvReceiver::StartWatcher() {
  if (watcher_started_ || engine_->clock() != RealClock()) return absl::OkStatus();
  absl::StatusOr<std::thread> t =
      StartThread("a KV receiver's prefill watcher", [this] { Watch(); });
  if (!t.ok()) return t.status();
  watcher_started_ = true;
  watcher_ = std::move(*t);
  return absl::OkStatus();
}

}  // namespace kvferry
