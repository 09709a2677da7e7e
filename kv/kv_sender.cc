// KvSender: the prefill side of the KV layer (engine/kv_cache.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

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
using kv_internal::ChecksummedBody;
using kv_internal::kMaxAuxBytes;
using kv_internal::kReadsBeginWords;
using kv_internal::KvMessage;
using kv_internal::NewToken;

// ---------------------------------------------------------------- sender

absl::StatusOr<std::unique_ptr<KvSender>> KvSender::Create(TransferEngine* engine, KvPool pool,
                                                           Options options) {
  if (!(options.peer_timeout > absl::ZeroDuration()) ||
      options.peer_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("KvSender: peer_timeout must be positive and finite");
  }
  RETURN_IF_ERROR(pool.Register(*engine, transport::Access::kNone));
  return std::unique_ptr<KvSender>(new KvSender(engine, std::move(pool), options));
}

absl::StatusOr<KvSender::Request*> KvSender::Find(Handle h) {
  auto it = requests_.find(h);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("unknown KV request ", h));
  return it->second.get();
}

absl::StatusOr<KvSender::Handle> KvSender::Begin(const std::string& request_id,
                                                 const std::string& peer,
                                                 absl::Span<const uint32_t> src_pages,
                                                 absl::Span<const uint32_t> dst_pages) {
  RETURN_IF_ERROR(CheckRequestId(request_id));
  absl::StatusOr<std::unique_ptr<Request>> r = Prepare(request_id, peer, src_pages, dst_pages);
  if (!r.ok()) {
    // The decode may be expecting it (KvReceiver::Expect): it is told the
    // request will not come, as it would be of a failure later (within
    // tell_timeout, each attempt bounded by it: a frozen decode costs
    // peer_timeout + tell_timeout here, not handshake timeouts).
    (void)Say([&]() -> absl::StatusOr<SegmentId> { return engine_->OpenSegment(peer); }, 0,
              KvMessage("fail", request_id, NewToken(),
                        absl::StrCat("not started: ", r.status().message())));
    return r.status();
  }
  (*r)->token = NewToken();
  if ((*r)->announce) Announce(**r);
  MutexLock lock(&mu_);
  const Handle h = ++last_;
  requests_[h] = std::move(*r);
  return h;
}

void KvSender::Announce(const Request& r) {
  // One attempt, within peer_timeout: a decode that calls Expect does not
  // need it, and one that cannot be told now hears of the request from its
  // last word.
  TransferEngine::NotifyOptions o;
  o.peer_engine_id = r.peer_engine_id;
  o.timeout = options_.peer_timeout;
  o.confirmable = true;  // a decode that waits without Expect confirms it first
  const absl::Status told =
      engine_->Notify(r.segment, KvMessage("begn", r.id, r.token, engine_->address()), o);
  if (!told.ok()) {
    KVF_LOG(INFO) << "KV request " << r.id << ": the decode was not told it began (" << told << ")";
  }
}

absl::StatusOr<std::unique_ptr<KvSender::Request>> KvSender::Prepare(
    const std::string& request_id, const std::string& peer, absl::Span<const uint32_t> src_pages,
    absl::Span<const uint32_t> dst_pages) {
  const KvLayout& mine = pool_.layout();
  ASSIGN_OR_RETURN(std::vector<PageRun> runs, CoalescePages(src_pages, dst_pages));
  if (options_.checksums && dst_pages.size() > kMaxChecksumPages) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV request ", request_id, ": ", dst_pages.size(),
                     " pages; with checksums at most ", kMaxChecksumPages, " per request"));
  }
  ASSIGN_OR_RETURN(SegmentId segment, engine_->OpenSegment(peer));
  ASSIGN_OR_RETURN(std::string published,
                   engine_->FetchMetadata(segment, kKvPoolMetadataKey, options_.peer_timeout));
  // The instance the pool description came from (FetchMetadata matched it
  // to the segment's last handshake).
  ASSIGN_OR_RETURN(const uint64_t instance, engine_->PeerEngineId(segment));
  ASSIGN_OR_RETURN(const uint64_t epoch, engine_->PeerEpoch(segment));
  const std::vector<std::string> lines = absl::StrSplit(published, '\n');
  if (lines.size() < 2) return absl::DataLossError("malformed KV pool description");
  ASSIGN_OR_RETURN(KvLayout theirs, KvLayout::Decode(lines[0]));
  if (theirs.layers != mine.layers || theirs.combined_kv != mine.combined_kv ||
      theirs.page_bytes() != mine.page_bytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the KV pool at ", peer, " (", theirs.Encode(), ") does not match this one (",
                     mine.Encode(), ")"));
  }
  auto r = std::make_unique<Request>();
  r->announce = options_.announce && lines.size() > 2 && lines[2] == kReadsBeginWords;
  for (absl::string_view a : absl::StrSplit(lines[1], ',', absl::SkipEmpty())) {
    uint64_t addr;
    if (!absl::SimpleHexAtoi(a, &addr)) return absl::DataLossError("malformed KV pool buffers");
    r->remote_buffers.push_back(reinterpret_cast<void*>(addr));
  }
  if (r->remote_buffers.size() != theirs.buffer_count()) {
    return absl::DataLossError("the peer's KV pool lists the wrong number of buffers");
  }
  for (const PageRun& run : runs) {
    if (uint64_t{run.src} + run.count > mine.pages ||
        uint64_t{run.dst} + run.count > theirs.pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", request_id, ": page run ", run.src, "->", run.dst, " x", run.count,
          " falls outside the pools (", mine.pages, " local, ", theirs.pages, " remote pages)"));
    }
  }
  r->id = request_id;
  r->segment = segment;
  r->peer_engine_id = instance;
  r->peer_epoch = epoch;
  r->runs = std::move(runs);
  r->sent.assign(mine.layers, false);
  return r;
}

absl::Status KvSender::SendLayer(Handle h, uint32_t layer) {
  std::vector<TransferRequest> transfers;
  SegmentId segment;
  uint64_t peer_engine_id, peer_epoch;
  {
    MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Request * r, Find(h));
    if (layer >= pool_.layout().layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " of ", pool_.layout().layers));
    }
    if (r->sent[layer]) return absl::OkStatus();
    r->sent[layer] = true;
    const KvLayout& l = pool_.layout();
    for (uint32_t kv = 0; kv < l.buffers_per_layer(); ++kv) {
      const uint32_t b = layer * l.buffers_per_layer() + kv;
      for (const PageRun& run : r->runs) {
        transfers.push_back(
            {transport::Opcode::kWrite, pool_.page(layer, kv, run.src),
             reinterpret_cast<uintptr_t>(r->remote_buffers[b]) + uint64_t{run.dst} * l.page_bytes(),
             uint64_t{run.count} * l.page_bytes()});
      }
    }
    segment = r->segment;
    peer_engine_id = r->peer_engine_id;
    peer_epoch = r->peer_epoch;
  }
  // Bound to the decode instance whose pool the addresses describe: after a
  // restart they would land in whatever its successor keeps there.
  absl::StatusOr<BatchId> batch = engine_->Submit(segment, transfers, peer_engine_id, peer_epoch);
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Request * r, Find(h));
  if (!batch.ok()) {
    if (r->error.ok()) r->error = batch.status();
    return batch.status();
  }
  r->batches.push_back(*batch);
  return absl::OkStatus();
}

absl::Status KvSender::SendAll(Handle h) {
  for (uint32_t layer = 0; layer < pool_.layout().layers; ++layer) {
    RETURN_IF_ERROR(SendLayer(h, layer));
  }
  return absl::OkStatus();
}

absl::Status KvSender::Drain(Request& r, bool* uncertain) {
  absl::Status first = r.error;
  // Any write posted may still land after it ended here: a copy of it
  // delayed in the network, or one still in flight after a timeout.
  *uncertain = !r.batches.empty();
  for (BatchId b : r.batches) {
    absl::StatusOr<BatchStatus> st = engine_->Wait(b, options_.timeout);
    if (st.ok()) {
      (void)engine_->Release(b);
      for (const absl::Status& s : st->requests) {
        if (first.ok() && !s.ok()) first = s;
      }
    } else if (first.ok()) {
      first = st.status();
    }
  }
  r.batches.clear();
  return first;
}

absl::Status KvSender::Tell(const Request& r, const std::string& message) {
  return Say([&]() -> absl::StatusOr<SegmentId> { return r.segment; }, r.peer_engine_id, message);
}

absl::Status KvSender::Say(const std::function<absl::StatusOr<SegmentId>()>& segment,
                           uint64_t instance, const std::string& message) {
  // A word lost to a passing outage is said again for up to tell_timeout: a
  // decode that hears nothing from this engine for its peer_timeout
  // declares it dead anyway (KvReceiver::Expect), so between the two every
  // request it expects ends there.
  Clock* clock = engine_->clock();
  const absl::Time deadline = clock->Now() + options_.tell_timeout;
  absl::Duration pause = absl::Milliseconds(1);
  for (;;) {
    absl::StatusOr<SegmentId> seg = segment();
    // Each attempt within what is left of tell_timeout (a frozen decode
    // must not hold it for a whole handshake timeout).
    const absl::Duration left = std::max(deadline - clock->Now(), absl::Milliseconds(1));
    TransferEngine::NotifyOptions o;
    o.peer_engine_id = instance;
    o.timeout = left;
    o.confirmable = true;  // the decode confirms a word with its sender
    absl::Status told = seg.ok() ? engine_->Notify(*seg, message, o) : seg.status();
    const bool passing = told.code() == absl::StatusCode::kUnavailable ||
                         told.code() == absl::StatusCode::kDeadlineExceeded;
    if (told.ok() || !passing || clock->Now() + pause >= deadline) return told;
    clock->SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(100));
  }
}

absl::StatusOr<std::unique_ptr<KvSender::Request>> KvSender::Take(Handle h) {
  MutexLock lock(&mu_);
  auto it = requests_.find(h);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("unknown KV request ", h));
  std::unique_ptr<Request> r = std::move(it->second);
  requests_.erase(it);
  return r;
}

absl::Status KvSender::Finish(Handle h, const std::string& aux) {
  if (aux.size() > kMaxAuxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("aux payload of ", aux.size(), " bytes exceeds ", kMaxAuxBytes));
  }
  (void)SendAll(h);  // a failure is recorded in the request
  ASSIGN_OR_RETURN(std::unique_ptr<Request> r, Take(h));
  bool uncertain = false;
  absl::Status data = Drain(*r, &uncertain);
  if (!data.ok()) {
    (void)Tell(*r, KvMessage(uncertain ? "abrt" : "fail", r->id, r->token, data.message()));
    return Annotate(data, absl::StrCat("KV request ", r->id));
  }
  if (options_.checksums) {
    absl::StatusOr<std::string> body = ChecksummedBody(pool_, r->runs, aux);
    if (!body.ok()) {
      // The bytes are at the decode, unvouched for: it must not use them.
      (void)Tell(*r, KvMessage("fail", r->id, r->token,
                               absl::StrCat("checksums: ", body.status().message())));
      return Annotate(body.status(), absl::StrCat("KV request ", r->id, ": checksums"));
    }
    return Tell(*r, KvMessage("donc", r->id, r->token, *body));
  }
  return Tell(*r, KvMessage("done", r->id, r->token, aux));
}

absl::Status KvSender::Cancel(Handle h, const std::string& reason) {
  ASSIGN_OR_RETURN(std::unique_ptr<Request> r, Take(h));
  bool uncertain = false;
  (void)Drain(*r, &uncertain);  // writes already posted cannot be recalled; let them land
  return Tell(*r, KvMessage(uncertain ? "abrt" : "fail", r->id, r->token,
                            absl::StrCat("cancelled: ", reason)));
}

absl::Status KvSender::Send(const std::string& request_id, const std::string& peer,
                            absl::Span<const uint32_t> src_pages,
                            absl::Span<const uint32_t> dst_pages, const std::string& aux) {
  ASSIGN_OR_RETURN(Handle h, Begin(request_id, peer, src_pages, dst_pages));
  return Finish(h, aux);
}

}  // namespace kvferry
