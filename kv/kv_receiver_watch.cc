// KvReceiver, watching the prefills that expected requests come from:
// probes, watch connections, deaths and fences (kv/kv_cache.h).
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

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
      WaitForEvents(std::min(wait, absl::Hours(1)));
      continue;
    }
    mu_.Unlock();
    CheckPrefills();
    mu_.Lock();
  }
  mu_.Unlock();
}

void KvReceiver::Wake() {
  if (!wake_.valid()) return;
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void KvReceiver::WaitForEvents(absl::Duration wait) {
  std::vector<pollfd> fds;
  std::vector<std::string> peers;
  if (wake_.valid()) fds.push_back(pollfd{wake_.get(), POLLIN, 0});
  for (const auto& [peer, fd] : watches_) {
    fds.push_back(pollfd{fd.get(), POLLIN | POLLRDHUP, 0});
    peers.push_back(peer);
  }
  if (!wake_.valid()) {  // no eventfd: the condition variable, without watches
    changed_.WaitWithTimeout(&mu_, wait);
    return;
  }
  mu_.Unlock();
  const int ms = static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), 1 << 30));
  (void)::poll(fds.data(), fds.size(), ms);
  if (fds[0].revents != 0) {
    uint64_t n;
    (void)!::read(wake_.get(), &n, sizeof n);
  }
  mu_.Lock();
  const absl::Time now = absl::Now();
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    // The peer sends nothing on a watch: any event is its end (or reset).
    auto w = watches_.find(peers[i - 1]);
    if (w == watches_.end() || w->second.get() != fds[i].fd) continue;
    retired_watches_.push_back(std::move(w->second));
    watches_.erase(w);
    auto p = prefills_.find(peers[i - 1]);
    if (p != prefills_.end()) {
      p->second.next_probe = now;
      p->second.quick_retries = kQuickRetries;
    }
  }
  retired_watches_.clear();  // no poll on them any more
}

void KvReceiver::CheckPrefills() {
  std::vector<std::pair<std::string, Prefill>> due;
  {
    MutexLock lock(&mu_);
    const absl::Time now = engine_->clock()->Now();
    for (const auto& [peer, p] : prefills_) {
      if (p.next_probe <= now) due.emplace_back(peer, p);
    }
  }
  if (due.empty()) return;
  std::vector<Probe> probes = ProbeAll(due);
  for (size_t i = 0; i < due.size(); ++i) Judge(due[i].first, due[i].second, probes[i]);
}

std::vector<KvReceiver::Probe> KvReceiver::ProbeAll(
    const std::vector<std::pair<std::string, Prefill>>& due) {
  // All due prefills are probed at once, so that many frozen ones (each
  // probe waiting out `period`) do not push the others past their bound.
  Clock* clock = engine_->clock();
  const absl::Duration period = options_.peer_timeout / 4;
  std::vector<Probe> probes(due.size());
  if (clock == RealClock()) {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < due.size(); ++i) probes[i].watched = watches_.count(due[i].first) != 0;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < due.size();) {
      probes[i].start = clock->Now();
      probes[i].id = engine_->ProbePeer(due[i].first, period);
      probes[i].end = clock->Now();
      if (probes[i].id.ok() && !probes[i].watched && clock == RealClock()) {
        absl::StatusOr<net::HostPort> hp = net::ParseHostPort(due[i].first);
        absl::StatusOr<net::Fd> fd = hp.ok() ? net::Connect(*hp, period) : hp.status();
        if (fd.ok()) probes[i].watch = std::move(*fd);
      }
    }
  };
  std::vector<std::thread> helpers;
  const size_t threads = std::min(due.size(), kMaxProbesAtOnce);
  for (size_t t = 1; t < threads && clock == RealClock(); ++t) {
    absl::StatusOr<std::thread> helper = StartThread("a KV receiver's probe", work);
    if (!helper.ok()) break;  // fewer at once, never none: this thread probes too
    helpers.push_back(std::move(*helper));
  }
  work();
  for (std::thread& t : helpers) t.join();
  return probes;
}

void KvReceiver::Judge(const std::string& peer, const Prefill& p, Probe& probe) {
  const absl::Duration period = options_.peer_timeout / 4;
  const absl::StatusOr<uint64_t>& id = probe.id;
  // Silent handshake, busy data links: alive (its probes may be starved
  // or lost; its writes are not). Only for an instance that presented
  // itself: links claiming a merely named id prove nothing.
  const uint64_t inputs = p.presented ? engine_->DataInputsFrom(p.engine_id) : 0;
  const bool data_moved = inputs > p.inputs;
  const absl::Status dead = DeathOf(peer, p, id, probe.end, data_moved);
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
  if (probe.watch.valid()) {
    watches_.emplace(peer, std::move(probe.watch));
    Wake();  // the watcher polls it from now on
  }
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

absl::Status KvReceiver::DeathOf(const std::string& peer, const Prefill& p,
                                 const absl::StatusOr<uint64_t>& id, absl::Time now,
                                 bool data_moved) const {
  const absl::Duration period = options_.peer_timeout / 4;
  // An instance fenced earlier that answers is alive: it comes back at a
  // later epoch (PeerService::Fence), and its new requests count.
  if (id.ok() && p.engine_id != 0 && *id != p.engine_id) {
    if (p.presented) {
      return absl::UnavailableError(absl::StrFormat(
          "the prefill at %s restarted (engine %#x, now %#x): its requests were lost", peer,
          p.engine_id, *id));
    }
    return absl::UnavailableError(absl::StrFormat(
        "the prefill at %s is not the engine named for its requests (%#x, it answers as %#x): "
        "it restarted, or the name was wrong",
        peer, p.engine_id, *id));
  }
  if (id.ok() || TransferEngine::PeerAnswered(id.status())) return absl::OkStatus();
  if (net::ConnectionRefused(id.status())) {
    // Nothing listens at its port: the process is gone (no need to wait).
    return absl::UnavailableError(absl::StrCat("the prefill at ", peer,
                                               " is gone: its port refuses connections (",
                                               id.status().message(), ")"));
  }
  if (!data_moved && now - p.last_answer >= options_.peer_timeout - period) {
    return absl::UnavailableError(
        absl::StrCat("the prefill at ", peer, " has not answered for ",
                     absl::FormatDuration(absl::Trunc(now - p.last_answer, absl::Milliseconds(1))),
                     " (", id.status().message(), ")"));
  }
  return absl::OkStatus();
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
    if (auto w = watches_.find(p->first); w != watches_.end()) {
      retired_watches_.push_back(std::move(w->second));  // the watcher may be polling it
      watches_.erase(w);
      Wake();
    }
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
