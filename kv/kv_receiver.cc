// KvReceiver: the decode side of the KV layer (engine/kv_cache.h).
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

using kv_internal::CheckRequestId;
using kv_internal::GetU32;
using kv_internal::kReadsBeginWords;
using kv_internal::PageCrcs;
using kv_internal::ParseWord;
using kv_internal::Word;

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
      wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

KvReceiver::~KvReceiver() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
    Wake();
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
  std::optional<std::pair<uint64_t, uint64_t>> early;  // its sender and digest
  {
    MutexLock lock(&mu_);
    auto e = early_.find(request_id);
    if (e != early_.end() && !e->second.confirmed &&
        (instance == 0 || e->second.engine_id == instance)) {
      early.emplace(e->second.engine_id, e->second.digest);
    }
  }
  bool confirmed = false;
  if (early.has_value()) {
    confirmed = engine_->ConfirmSent(peer, early->first, early->second, options_.peer_timeout / 4)
                    .value_or(false);
  }
  bool start = false;
  {
    MutexLock lock(&mu_);
    ClaimEarly(request_id, instance, /*expected=*/true, confirmed);
    begun_.erase(request_id);  // Expect names the prefill itself
    Status& s = requests_[request_id];
    // Its word came first (the prefill was quicker than this call): there
    // is nothing left to watch.
    if (s.state != State::kPending) return absl::OkStatus();
    if (auto again = expected_.find(request_id); again != expected_.end()) Unexpect(again);
    auto [known, fresh] = prefills_.try_emplace(
        peer, Prefill{instance, presented, now, probe_now ? now : now + options_.peer_timeout / 4});
    if (!fresh && prefill_engine_id != 0 && known->second.engine_id == 0) {
      known->second.engine_id = prefill_engine_id;
    }
    ++known->second.expected;
    expected_[request_id] = peer;
    start = !watcher_started_ && engine_->clock() == RealClock();
    watcher_started_ = watcher_started_ || start;
    changed_.SignalAll();
    Wake();
  }
  if (start) {
    absl::StatusOr<std::thread> t =
        StartThread("a KV receiver's prefill watcher", [this] { Watch(); });
    if (!t.ok()) {
      MutexLock lock(&mu_);
      watcher_started_ = false;
      if (auto e = expected_.find(request_id); e != expected_.end()) Unexpect(e);
      return t.status();
    }
    watcher_ = std::move(*t);
  }
  return absl::OkStatus();
}

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
  Clock* clock = engine_->clock();
  const absl::Duration period = options_.peer_timeout / 4;
  std::vector<std::pair<std::string, Prefill>> due;
  {
    MutexLock lock(&mu_);
    const absl::Time now = clock->Now();
    for (const auto& [peer, p] : prefills_) {
      if (p.next_probe <= now) due.emplace_back(peer, p);
    }
  }
  if (due.empty()) return;
  // All due prefills are probed at once, so that many frozen ones (each
  // probe waiting out `period`) do not push the others past their bound.
  struct Probe {
    absl::Time start, end;
    absl::StatusOr<uint64_t> id = absl::UnknownError("not probed");
    bool watched = false;  // it has a watch connection
    net::Fd watch;         // one opened now
  };
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

  for (size_t i = 0; i < due.size(); ++i) {
    const auto& [peer, p] = due[i];
    const absl::StatusOr<uint64_t>& id = probes[i].id;
    // Silent handshake, busy data links: alive (its probes may be starved
    // or lost; its writes are not). Only for an instance that presented
    // itself: links claiming a merely named id prove nothing.
    const uint64_t inputs = p.presented ? engine_->DataInputsFrom(p.engine_id) : 0;
    const bool data_moved = inputs > p.inputs;
    const absl::Status dead = DeathOf(peer, p, id, probes[i].end, data_moved);
    // Fenced before anyone is told: nothing of it lands afterwards. Only an
    // id the prefill presented itself: never one a caller merely named.
    if (!dead.ok() && p.engine_id != 0 && p.presented) {
      engine_->FencePeer(p.engine_id, dead.message());
    }
    MutexLock lock(&mu_);
    auto it = prefills_.find(peer);
    if (it == prefills_.end()) continue;
    if (!dead.ok()) {
      FailFrom(peer, dead);  // forgets the prefill with its last request
      continue;
    }
    if (id.ok()) {
      it->second.engine_id = *id;
      it->second.presented = true;
    }
    if (probes[i].watch.valid()) {
      watches_.emplace(peer, std::move(probes[i].watch));
      Wake();  // the watcher polls it from now on
    }
    // An answer, even a refusal (an overloaded or fencing engine), means
    // its process is alive.
    if (id.ok() || TransferEngine::PeerAnswered(id.status()) || data_moved) {
      it->second.last_answer = probes[i].end;
    }
    it->second.inputs = std::max(it->second.inputs, inputs);
    it->second.next_probe = probes[i].start + period;
    if (id.ok() || TransferEngine::PeerAnswered(id.status())) {
      it->second.quick_retries = 0;
    } else if (it->second.quick_retries > 0) {
      --it->second.quick_retries;
      it->second.next_probe = std::min(it->second.next_probe, probes[i].end + kQuickRetry);
    }
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

std::vector<KvReceiver::Vetted> KvReceiver::Vet(std::vector<Notification> notes) {
  std::vector<Vetted> out;
  out.reserve(notes.size());
  absl::flat_hash_set<std::string> unreachable;  // prefills that did not answer this round
  for (Notification& n : notes) {
    Vetted v{std::move(n), false, false};
    const std::optional<Word> w = ParseWord(v.n.message);
    std::string prefill;  // where its request is expected from
    if (w.has_value()) {
      MutexLock lock(&mu_);
      auto e = expected_.find(std::string(w->id));
      auto p = e == expected_.end() ? prefills_.end() : prefills_.find(e->second);
      // From another engine than the one answering there: Absorb ignores it.
      if (p != prefills_.end() &&
          (p->second.engine_id == 0 || p->second.engine_id == v.n.engine_id)) {
        prefill = p->first;
      }
      // A begin word about a request nobody expects is asked about at the
      // address it names (the engine there must be its sender); one about
      // an expected request is not needed.
      if (w->kind == "begn") {
        const auto hp = net::ParseHostPort(w->body);
        prefill = e == expected_.end() && hp.ok() ? hp->ToString() : "";
      }
    }
    if (!prefill.empty()) {
      if (unreachable.contains(prefill)) {
        v.unasked = true;  // it did not answer this round: asked again later
      } else {
        absl::StatusOr<bool> c = engine_->ConfirmSent(
            prefill, v.n.engine_id, TransferEngine::NotificationDigest(v.n.message),
            options_.peer_timeout / 4);
        v.confirmed = c.value_or(false);
        v.unasked = !c.ok();
        if (!c.ok()) unreachable.insert(prefill);
      }
    }
    out.push_back(std::move(v));
  }
  return out;
}

void KvReceiver::TakeWords() {
  std::vector<Notification> notes = std::move(unasked_);
  unasked_.clear();
  mu_.Unlock();
  for (Notification& n : engine_->TakeNotifications(IsWord)) notes.push_back(std::move(n));
  std::vector<Vetted> words = Vet(std::move(notes));
  mu_.Lock();
  Absorb(std::move(words));
}

void KvReceiver::Absorb(std::vector<Vetted> words) {
  // Begin words adopted after the batch: the other words in it were vetted
  // without the expectation, and are taken as such.
  std::vector<std::string> adopt;
  for (Vetted& v : words) {
    const Notification& n = v.n;
    const std::optional<Word> w = ParseWord(n.message);
    if (!w.has_value()) continue;  // taken only when IsWord said so
    const std::string id(w->id);
    // A word about an attempt whose request was finished and forgotten (said
    // again after a lost reply, or late): not about what is expected now.
    if (w->token != 0 && retired_.Contains({id, w->token})) {
      ++ignored_words_;
      continue;
    }
    if (w->kind == "begn") {
      if (Announced(id, v, w->body)) adopt.push_back(id);
      continue;
    }
    // A word for a request expected from another prefill instance (one
    // that died, or its successor) is not about this request: ignored.
    if (auto e = expected_.find(id); e != expected_.end()) {
      auto from = prefills_.find(e->second);
      if (from != prefills_.end() && from->second.engine_id != 0 &&
          from->second.engine_id != n.engine_id) {
        ++ignored_words_;
        continue;
      }
      if (!v.confirmed && v.unasked) {
        // Its prefill could not be asked now: asked again by the next
        // Poll or Wait (until the prefill is declared dead, and its
        // request failed). Bounded: the oldest go first.
        if (unasked_.size() >= kMaxEarlyWords) {
          unasked_.erase(unasked_.begin());
          ++dropped_early_;
        }
        unasked_.push_back(std::move(v.n));
        continue;
      }
      if (!v.confirmed) {
        ++unconfirmed_;  // the engine it names said it did not send it: forged
        continue;
      }
      Unexpect(e);
    } else if (requests_.find(id) == requests_.end()) {
      // Nobody expects it or waits for it (yet): kept a while, bounded.
      if (early_.count(id) != 0) continue;  // first word wins
      Early early;
      early.status = Resolve(id, *w, n.engine_id, n.source, v.confirmed);
      early.engine_id = n.engine_id;
      early.token = w->token;
      early.digest = TransferEngine::NotificationDigest(n.message);
      early.confirmed = v.confirmed;
      early.source = n.source;
      KeepEarly(id, std::move(early));
      continue;
    }
    Status& s = requests_[id];
    if (s.state != State::kPending) continue;  // first word wins
    if (w->token != 0) tokens_[id] = w->token;
    s = Resolve(id, *w, n.engine_id, n.source, v.confirmed);
  }
  for (const std::string& id : adopt) Adopt(id);
  ExpireEarly();
}

bool KvReceiver::Announced(const std::string& id, const Vetted& v, absl::string_view prefill) {
  if (expected_.count(id) != 0) return false;  // Expect named its prefill
  auto r = requests_.find(id);
  if (r != requests_.end() && r->second.state != State::kPending) return false;
  if (!v.confirmed) {
    if (v.unasked) return false;  // its sender did not answer: the request's own words still count
    ++unconfirmed_;               // the engine at the address it names did not send it
    return false;
  }
  const absl::StatusOr<net::HostPort> hp = net::ParseHostPort(prefill);
  if (!hp.ok()) return false;
  if (begun_.size() >= kMaxEarlyWords) {
    auto oldest = std::min_element(begun_.begin(), begun_.end(), [](const auto& a, const auto& b) {
      return a.second.arrived < b.second.arrived;
    });
    begun_.erase(oldest);
    ++dropped_early_;
  }
  begun_[id] = Begun{hp->ToString(), v.n.engine_id, engine_->clock()->Now()};
  return r != requests_.end();  // a Poll or Wait asks for it already
}

void KvReceiver::Adopt(const std::string& id) {
  auto b = begun_.find(id);
  if (b == begun_.end()) return;
  const Begun begun = std::move(b->second);
  begun_.erase(b);
  if (expected_.count(id) != 0) return;
  if (engine_->clock()->Now() - begun.arrived >= options_.early_word_ttl) return;
  const Status& s = requests_[id];
  if (s.state != State::kPending) return;
  // As Expect(id, prefill, engine id) would, the id presented by the
  // engine at that address (it confirmed the word): probed from now on.
  const absl::Time now = engine_->clock()->Now();
  auto [known, fresh] =
      prefills_.try_emplace(begun.prefill, Prefill{begun.engine_id, /*presented=*/true, now, now});
  if (!fresh && known->second.engine_id == 0) known->second.engine_id = begun.engine_id;
  ++known->second.expected;
  expected_[id] = begun.prefill;
  changed_.SignalAll();
  Wake();
  if (absl::Status started = StartWatcher(); !started.ok()) {
    KVF_LOG(WARNING) << "KV request " << id << " is not watched: " << started;
    Unexpect(expected_.find(id));
  }
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

KvReceiver::Status KvReceiver::Resolve(const std::string& id, const Word& w, uint64_t from,
                                       absl::string_view source, bool confirmed) {
  Status s;
  if (w.kind == "done") {
    s.state = State::kComplete;
    s.aux = std::string(w.body);
  } else if (w.kind == "donc") {
    absl::StatusOr<std::string> aux = Verify(id, w.body);
    s.state = aux.ok() ? State::kComplete : State::kFailed;
    if (aux.ok()) {
      s.aux = std::move(*aux);
    } else {
      s.error = aux.status();
    }
  } else {
    // A write the sender gave up on may still be on its way: its links are
    // dropped first, so nothing of it lands after this report. Only for a
    // word its sender confirmed: a forged one must not cut an innocent
    // engine's links.
    if (w.kind == "abrt") engine_->DropLinksFrom(from, confirmed ? "" : source);
    s.state = State::kFailed;
    s.error = absl::AbortedError(absl::StrCat("the sender failed the request: ", w.body));
  }
  return s;
}

void KvReceiver::KeepEarly(const std::string& id, Early e) {
  const size_t bytes = e.status.aux.size() + id.size();
  if (bytes > kMaxEarlyBytes) {
    ++dropped_early_;
    return;
  }
  while (!early_.empty() &&
         (early_.size() >= kMaxEarlyWords || early_bytes_ + bytes > kMaxEarlyBytes)) {
    DropEarly(early_.find(early_order_.begin()->second));
  }
  e.arrived = engine_->clock()->Now();
  e.seq = ++early_seq_;
  early_order_.emplace(e.seq, id);
  early_bytes_ += bytes;
  early_.emplace(id, std::move(e));
}

KvReceiver::Early KvReceiver::TakeEarly(std::map<std::string, Early>::iterator it) {
  Early e = std::move(it->second);
  early_bytes_ -= e.status.aux.size() + it->first.size();
  early_order_.erase(e.seq);
  early_.erase(it);
  return e;
}

void KvReceiver::DropEarly(std::map<std::string, Early>::iterator it) {
  ++dropped_early_;
  (void)TakeEarly(it);
}

void KvReceiver::ExpireEarly() {
  const absl::Time now = engine_->clock()->Now();
  while (!early_order_.empty()) {
    auto it = early_.find(early_order_.begin()->second);
    if (now - it->second.arrived < options_.early_word_ttl) return;
    DropEarly(it);
  }
}

void KvReceiver::ClaimEarly(const std::string& id, uint64_t instance, bool expected,
                            bool confirmed) {
  auto it = early_.find(id);
  if (it == early_.end()) return;
  Early e = TakeEarly(it);
  if (instance != 0 && e.engine_id != instance) {
    ++ignored_words_;  // from another engine than the one expected
    return;
  }
  if (expected && !e.confirmed && !confirmed) {
    ++unconfirmed_;  // the prefill did not say it sent it
    return;
  }
  // Without an Expect nothing names the prefill to ask: the word must at
  // least come from where the engine it names opened its links here from.
  if (!expected && !e.confirmed && !e.source.empty() &&
      !engine_->HasLinksFrom(e.engine_id, e.source)) {
    ++unconfirmed_;
    return;
  }
  Status& s = requests_[id];
  if (s.state != State::kPending) return;
  if (e.token != 0) tokens_[id] = e.token;
  s = std::move(e.status);
}

KvReceiver::Status KvReceiver::Poll(const std::string& request_id) {
  MutexLock lock(&mu_);
  TakeWords();
  if (requests_.find(request_id) == requests_.end()) ClaimEarly(request_id, 0, false, false);
  auto it = requests_.find(request_id);
  if (it == requests_.end() && begun_.count(request_id) != 0) {
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

absl::StatusOr<std::string> KvReceiver::Verify(const std::string& request_id,
                                               absl::string_view body) {
  const KvLayout& l = pool_.layout();
  auto malformed = [&] {
    return absl::DataLossError(
        absl::StrCat("KV request ", request_id, ": malformed checksummed completion"));
  };
  uint32_t nruns = 0;
  if (!GetU32(&body, &nruns) || nruns > l.pages) return malformed();
  std::vector<PageRun> runs(nruns);
  for (PageRun& r : runs) {
    if (!GetU32(&body, &r.dst) || !GetU32(&body, &r.count) || r.dst >= l.pages ||
        r.count > l.pages - r.dst) {
      return malformed();
    }
  }
  std::vector<uint32_t> want;
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i) {
      uint32_t crc = 0;
      if (!GetU32(&body, &crc)) return malformed();
      want.push_back(crc);
    }
  }
  absl::StatusOr<std::vector<uint32_t>> got = PageCrcs(pool_, runs, /*dst=*/true);
  if (!got.ok()) {
    return absl::DataLossError(absl::StrCat(
        "KV request ", request_id, ": its pages cannot be checked: ", got.status().message()));
  }
  size_t k = 0;
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i, ++k) {
      if ((*got)[k] != want[k]) {
        ++checksum_failures_;
        return absl::DataLossError(absl::StrFormat(
            "KV request %s: page %u differs from what the sender sent (CRC-32C %08x, expected "
            "%08x): corrupted in transit",
            request_id, r.dst + i, (*got)[k], want[k]));
      }
    }
  }
  return std::string(body);
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
  return dropped_early_;
}

uint64_t KvReceiver::checksum_failures() const {
  MutexLock lock(&mu_);
  return checksum_failures_;
}

void KvReceiver::Forget(const std::string& request_id) {
  MutexLock lock(&mu_);
  requests_.erase(request_id);
  begun_.erase(request_id);
  if (auto early = early_.find(request_id); early != early_.end()) {
    (void)TakeEarly(early);  // forgotten by the application, not dropped
  }
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
