// KvReceiver, taking the KV words: vetting (confirmation with their
// senders), early words, begin words and what each word resolves
// (kv/kv_cache.h).
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
#include "kv/kv_receiver_internal.h"
#include "kv/kv_words.h"
#include "net/socket.h"

namespace kvferry {
namespace kv_internal {

std::vector<Vetted> WordTaker::Vet(std::vector<Notification> notes) {
  std::vector<Vetted> out;
  out.reserve(notes.size());
  absl::flat_hash_set<std::string> unreachable;  // prefills that did not answer this round
  for (Notification& n : notes) {
    Vetted v{std::move(n), false, false};
    const std::optional<Word> w = ParseWord(v.n.message);
    std::string prefill;  // where its request is expected from
    if (w.has_value()) {
      MutexLock lock(&s_.mu);
      auto e = s_.expected.find(std::string(w->id));
      auto p = e == s_.expected.end() ? s_.prefills.end() : s_.prefills.find(e->second);
      // From another engine than the one answering there: Absorb ignores it.
      if (p != s_.prefills.end() &&
          (p->second.engine_id == 0 || p->second.engine_id == v.n.engine_id)) {
        prefill = p->first;
      }
      // A begin word about a request nobody expects is asked about at the
      // address it names (the engine there must be its sender); one about
      // an expected request is not needed.
      if (w->kind == "begn") {
        const auto hp = net::ParseHostPort(w->body);
        prefill = e == s_.expected.end() && hp.ok() ? hp->ToString() : "";
      }
    }
    if (!prefill.empty()) {
      if (unreachable.contains(prefill)) {
        v.unasked = true;  // it did not answer this round: asked again later
      } else {
        absl::StatusOr<bool> c = s_.engine->ConfirmSent(
            prefill, v.n.engine_id, TransferEngine::NotificationDigest(v.n.message),
            s_.peer_timeout / 4);
        v.confirmed = c.value_or(false);
        v.unasked = !c.ok();
        if (!c.ok()) unreachable.insert(prefill);
      }
    }
    out.push_back(std::move(v));
  }
  return out;
}

void WordTaker::TakeWords(ReceiverState& s) {
  std::vector<Notification> notes = std::move(s.unasked);
  s.unasked.clear();
  s.mu.Unlock();
  for (Notification& n : s.engine->TakeNotifications(KvReceiver::IsWord))
    notes.push_back(std::move(n));
  std::vector<Vetted> words = Vet(std::move(notes));
  s.mu.Lock();
  Absorb(s, std::move(words));
}

void WordTaker::Absorb(ReceiverState& s, std::vector<Vetted> words) {
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
    if (w->token != 0 && s.retired.Contains({id, w->token})) {
      ++s.ignored_words;
      continue;
    }
    if (w->kind == "begn") {
      if (Announced(s, id, v, w->body)) adopt.push_back(id);
      continue;
    }
    if (auto e = s.expected.find(id); e != s.expected.end()) {
      if (!TakeExpected(s, v, e)) continue;
    } else if (s.requests.find(id) == s.requests.end()) {
      // Nobody expects it or waits for it (yet): kept a while, bounded.
      if (s.early.Find(id) != nullptr) continue;  // first word wins
      EarlyWord early;
      early.status = Resolve(s, id, *w, n.engine_id, n.source, v.confirmed);
      early.engine_id = n.engine_id;
      early.token = w->token;
      early.digest = TransferEngine::NotificationDigest(n.message);
      early.confirmed = v.confirmed;
      early.source = n.source;
      s.early.Keep(id, std::move(early));
      continue;
    }
    KvRequestStatus& r = s.requests[id];
    if (r.state != KvRequestState::kPending) continue;  // first word wins
    if (w->token != 0) s.tokens[id] = w->token;
    r = Resolve(s, id, *w, n.engine_id, n.source, v.confirmed);
  }
  for (const std::string& id : adopt) Adopt(s, id);
  s.early.Expire();
}

bool WordTaker::TakeExpected(ReceiverState& s, Vetted& v, Expectation e) {
  // A word for a request expected from another prefill instance (one that
  // died, or its successor) is not about this request: ignored.
  auto from = s.prefills.find(e->second);
  if (from != s.prefills.end() && from->second.engine_id != 0 &&
      from->second.engine_id != v.n.engine_id) {
    ++s.ignored_words;
    return false;
  }
  if (!v.confirmed && v.unasked) {
    // Its prefill could not be asked now: asked again by the next Poll or
    // Wait (until the prefill is declared dead, and its request failed).
    // Bounded: the oldest go first.
    if (s.unasked.size() >= kMaxEarlyWords) {
      s.unasked.erase(s.unasked.begin());
      s.early.CountDrop();
    }
    s.unasked.push_back(std::move(v.n));
    return false;
  }
  if (!v.confirmed) {
    ++s.unconfirmed;  // the engine it names said it did not send it: forged
    return false;
  }
  watcher_.Unexpect(s, e);
  return true;
}

bool WordTaker::Announced(ReceiverState& s, const std::string& id, const Vetted& v,
                          absl::string_view prefill) {
  if (s.expected.count(id) != 0) return false;  // Expect named its prefill
  auto r = s.requests.find(id);
  if (r != s.requests.end() && r->second.state != KvRequestState::kPending) return false;
  if (!v.confirmed) {
    if (v.unasked) return false;  // its sender did not answer: the request's own words still count
    ++s.unconfirmed;              // the engine at the address it names did not send it
    return false;
  }
  const absl::StatusOr<net::HostPort> hp = net::ParseHostPort(prefill);
  if (!hp.ok()) return false;
  s.early.Announce(id, BegunWord{hp->ToString(), v.n.engine_id, absl::Time()});
  return r != s.requests.end();  // a Poll or Wait asks for it already
}

void WordTaker::Adopt(ReceiverState& s, const std::string& id) {
  const std::optional<BegunWord> begun = s.early.TakeBegun(id);  // if not too old
  if (!begun.has_value() || s.expected.count(id) != 0) return;
  const KvRequestStatus& r = s.requests[id];
  if (r.state != KvRequestState::kPending) return;
  // As Expect(id, prefill, engine id) would, the id presented by the
  // engine at that address (it confirmed the word): probed from now on.
  const absl::Time now = s.engine->clock()->Now();
  absl::Status watched = watcher_.ExpectFrom(
      s, id, begun->prefill, PrefillState{begun->engine_id, /*presented=*/true, now, now},
      begun->engine_id);
  if (!watched.ok()) KVF_LOG(WARNING) << "KV request " << id << " is not watched: " << watched;
}

KvRequestStatus WordTaker::Resolve(ReceiverState& s, const std::string& id, const Word& w,
                                   uint64_t from, absl::string_view source, bool confirmed) {
  KvRequestStatus r;
  if (w.kind == "done") {
    r.state = KvRequestState::kComplete;
    r.aux = std::string(w.body);
  } else if (w.kind == "donc") {
    absl::StatusOr<std::string> aux = Verify(s, id, w.body);
    r.state = aux.ok() ? KvRequestState::kComplete : KvRequestState::kFailed;
    if (aux.ok()) {
      r.aux = std::move(*aux);
    } else {
      r.error = aux.status();
    }
  } else {
    // A write the sender gave up on may still be on its way: its links are
    // dropped first, so nothing of it lands after this report. Only for a
    // word its sender confirmed: a forged one must not cut an innocent
    // engine's links.
    if (w.kind == "abrt") s.engine->DropLinksFrom(from, confirmed ? "" : source);
    r.state = KvRequestState::kFailed;
    r.error = absl::AbortedError(absl::StrCat("the sender failed the request: ", w.body));
  }
  return r;
}

void WordTaker::ClaimEarly(ReceiverState& s, const std::string& id, uint64_t instance,
                           bool expected, bool confirmed) {
  std::optional<EarlyWord> e = s.early.Take(id);
  if (!e.has_value()) return;
  if (instance != 0 && e->engine_id != instance) {
    ++s.ignored_words;  // from another engine than the one expected
    return;
  }
  if (expected && !e->confirmed && !confirmed) {
    ++s.unconfirmed;  // the prefill did not say it sent it
    return;
  }
  // Without an Expect nothing names the prefill to ask: the word must at
  // least come from where the engine it names opened its links here from.
  if (!expected && !e->confirmed && !e->source.empty() &&
      !s.engine->HasLinksFrom(e->engine_id, e->source)) {
    ++s.unconfirmed;
    return;
  }
  KvRequestStatus& r = s.requests[id];
  if (r.state != KvRequestState::kPending) return;
  if (e->token != 0) s.tokens[id] = e->token;
  r = std::move(e->status);
}

absl::StatusOr<std::string> WordTaker::Verify(ReceiverState& s, const std::string& request_id,
                                              absl::string_view body) {
  const KvLayout& l = s.pool->layout();
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
  absl::StatusOr<std::vector<uint32_t>> got = PageCrcs(*s.pool, runs, /*dst=*/true);
  if (!got.ok()) {
    return absl::DataLossError(absl::StrCat(
        "KV request ", request_id, ": its pages cannot be checked: ", got.status().message()));
  }
  size_t k = 0;
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i, ++k) {
      if ((*got)[k] != want[k]) {
        ++s.checksum_failures;
        return absl::DataLossError(absl::StrFormat(
            "KV request %s: page %u differs from what the sender sent (CRC-32C %08x, expected "
            "%08x): corrupted in transit",
            request_id, r.dst + i, (*got)[k], want[k]));
      }
    }
  }
  return std::string(body);
}

bool WordTaker::ConfirmEarly(const std::string& request_id, uint64_t instance,
                             const std::string& peer) {
  std::optional<std::pair<uint64_t, uint64_t>> early;  // its sender and digest
  {
    MutexLock lock(&s_.mu);
    const EarlyWord* e = s_.early.Find(request_id);
    if (e != nullptr && !e->confirmed && (instance == 0 || e->engine_id == instance)) {
      early.emplace(e->engine_id, e->digest);
    }
  }
  if (!early.has_value()) return false;
  return s_.engine->ConfirmSent(peer, early->first, early->second, s_.peer_timeout / 4)
      .value_or(false);
}

}  // namespace kv_internal
}  // namespace kvferry
