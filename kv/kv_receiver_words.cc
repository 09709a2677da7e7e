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
#include "kv/kv_words.h"
#include "net/socket.h"

namespace kvferry {

using kv_internal::GetU32;
using kv_internal::PageCrcs;
using kv_internal::ParseWord;
using kv_internal::Word;
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
    if (auto e = expected_.find(id); e != expected_.end()) {
      if (!TakeExpected(v, e)) continue;
    } else if (requests_.find(id) == requests_.end()) {
      // Nobody expects it or waits for it (yet): kept a while, bounded.
      if (early_->Find(id) != nullptr) continue;  // first word wins
      kv_internal::EarlyWord early;
      early.status = Resolve(id, *w, n.engine_id, n.source, v.confirmed);
      early.engine_id = n.engine_id;
      early.token = w->token;
      early.digest = TransferEngine::NotificationDigest(n.message);
      early.confirmed = v.confirmed;
      early.source = n.source;
      early_->Keep(id, std::move(early));
      continue;
    }
    Status& s = requests_[id];
    if (s.state != State::kPending) continue;  // first word wins
    if (w->token != 0) tokens_[id] = w->token;
    s = Resolve(id, *w, n.engine_id, n.source, v.confirmed);
  }
  for (const std::string& id : adopt) Adopt(id);
  early_->Expire();
}

bool KvReceiver::TakeExpected(Vetted& v, std::map<std::string, std::string>::iterator e) {
  // A word for a request expected from another prefill instance (one that
  // died, or its successor) is not about this request: ignored.
  auto from = prefills_.find(e->second);
  if (from != prefills_.end() && from->second.engine_id != 0 &&
      from->second.engine_id != v.n.engine_id) {
    ++ignored_words_;
    return false;
  }
  if (!v.confirmed && v.unasked) {
    // Its prefill could not be asked now: asked again by the next Poll or
    // Wait (until the prefill is declared dead, and its request failed).
    // Bounded: the oldest go first.
    if (unasked_.size() >= kMaxEarlyWords) {
      unasked_.erase(unasked_.begin());
      early_->CountDrop();
    }
    unasked_.push_back(std::move(v.n));
    return false;
  }
  if (!v.confirmed) {
    ++unconfirmed_;  // the engine it names said it did not send it: forged
    return false;
  }
  Unexpect(e);
  return true;
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
  early_->Announce(id, kv_internal::BegunWord{hp->ToString(), v.n.engine_id, absl::Time()});
  return r != requests_.end();  // a Poll or Wait asks for it already
}

void KvReceiver::Adopt(const std::string& id) {
  const std::optional<kv_internal::BegunWord> begun = early_->TakeBegun(id);  // if not too old
  if (!begun.has_value() || expected_.count(id) != 0) return;
  const Status& s = requests_[id];
  if (s.state != State::kPending) return;
  // As Expect(id, prefill, engine id) would, the id presented by the
  // engine at that address (it confirmed the word): probed from now on.
  const absl::Time now = engine_->clock()->Now();
  absl::Status watched =
      ExpectFrom(id, begun->prefill, Prefill{begun->engine_id, /*presented=*/true, now, now},
                 begun->engine_id);
  if (!watched.ok()) KVF_LOG(WARNING) << "KV request " << id << " is not watched: " << watched;
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

void KvReceiver::ClaimEarly(const std::string& id, uint64_t instance, bool expected,
                            bool confirmed) {
  std::optional<kv_internal::EarlyWord> e = early_->Take(id);
  if (!e.has_value()) return;
  if (instance != 0 && e->engine_id != instance) {
    ++ignored_words_;  // from another engine than the one expected
    return;
  }
  if (expected && !e->confirmed && !confirmed) {
    ++unconfirmed_;  // the prefill did not say it sent it
    return;
  }
  // Without an Expect nothing names the prefill to ask: the word must at
  // least come from where the engine it names opened its links here from.
  if (!expected && !e->confirmed && !e->source.empty() &&
      !engine_->HasLinksFrom(e->engine_id, e->source)) {
    ++unconfirmed_;
    return;
  }
  Status& s = requests_[id];
  if (s.state != State::kPending) return;
  if (e->token != 0) tokens_[id] = e->token;
  s = std::move(e->status);
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

}  // namespace kvferry
