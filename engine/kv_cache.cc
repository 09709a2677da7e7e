#include "engine/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "net/socket.h"

namespace kvferry {
namespace {

constexpr size_t kMaxAuxBytes = 512 << 10;
constexpr char kSep = '\0';

// KV-layer notifications, "kv2\0<kind>\0<id>\0<token>\0<body>": done
// (body: aux), donc (done with per-page checksums), fail (failed before any
// write was posted; body: the reason) and abrt (failed after writes were
// posted: the receiver drops the sender's links before it reports the
// failure, so that no late copy of them lands afterwards). <token> (16 hex
// digits) names the attempt: a word said again, or one from an earlier
// attempt at a request id the decode has since forgotten and expects again,
// is recognised and ignored. Receivers still read "kv1" words (no token).
std::string KvMessage(absl::string_view kind, absl::string_view id, uint64_t token,
                      absl::string_view body) {
  const std::string sep(1, kSep);
  return absl::StrCat("kv2", sep, kind, sep, id, sep, absl::Hex(token, absl::kZeroPad16), sep,
                      body);
}

// A KV word as KvMessage writes it (or an older sender's "kv1" word, no
// token); nullopt for any other notification. Views into `message`.
struct Word {
  absl::string_view kind, id, body;
  uint64_t token = 0;
};
std::optional<Word> ParseWord(absl::string_view message) {
  std::vector<absl::string_view> p = absl::StrSplit(message, absl::MaxSplits(kSep, 3));
  if (p.size() != 4 || (p[0] != "kv1" && p[0] != "kv2")) return std::nullopt;
  Word w{p[1], p[2], p[3]};
  if (p[0] == "kv2") {
    if (w.body.size() < 17 || w.body[16] != kSep ||
        !absl::SimpleHexAtoi(w.body.substr(0, 16), &w.token)) {
      return std::nullopt;
    }
    w.body.remove_prefix(17);
  }
  if (w.kind != "done" && w.kind != "donc" && w.kind != "fail" && w.kind != "abrt") {
    return std::nullopt;
  }
  return w;
}

// A fresh attempt token: random per process, then counted.
uint64_t NewToken() {
  static std::atomic<uint64_t> next{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  const uint64_t t = next.fetch_add(0x9e3779b97f4a7c15ull);
  return t == 0 ? 1 : t;
}

// The CRC-32C of page `page` across every buffer of `pool`.
uint32_t PageCrc(const KvPool& pool, uint32_t page) {
  const KvLayout& l = pool.layout();
  uint32_t crc = 0;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    crc = Crc32c(pool.buffer(b) + uint64_t{page} * l.page_bytes(), l.page_bytes(), crc);
  }
  return crc;
}

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  out->append(b, 4);
}

bool GetU32(absl::string_view* in, uint32_t* v) {
  if (in->size() < 4) return false;
  std::memcpy(v, in->data(), 4);
  in->remove_prefix(4);
  return true;
}

// The body of a "donc" message: u32 runs, (u32 dst, u32 count) each, the
// CRC of every destination page in run order, then the aux payload.
std::string ChecksummedBody(const KvPool& pool, const std::vector<PageRun>& runs,
                            absl::string_view aux) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(runs.size()));
  for (const PageRun& r : runs) {
    PutU32(&out, r.dst);
    PutU32(&out, r.count);
  }
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i) PutU32(&out, PageCrc(pool, r.src + i));
  }
  out.append(aux.data(), aux.size());
  return out;
}

absl::Status CheckRequestId(const std::string& id) {
  if (id.empty() || id.find(kSep) != std::string::npos) {
    return absl::InvalidArgumentError("request ids must be non-empty and contain no NUL");
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------- layout

absl::Status KvLayout::Validate() const {
  if (layers == 0 || layers > 4096 || page_tokens == 0 || bytes_per_token == 0 || pages == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad KV layout: layers=", layers, " page_tokens=", page_tokens,
        " bytes_per_token=", bytes_per_token, " pages=", pages, " (all must be positive)"));
  }
  if (bytes_per_token > (uint64_t{1} << 30) / page_tokens ||
      page_bytes() > (uint64_t{1} << 44) / pages) {
    return absl::InvalidArgumentError("bad KV layout: buffers would exceed 16 TiB");
  }
  return absl::OkStatus();
}

std::string KvLayout::Encode() const {
  return absl::StrCat("kv1 layers=", layers, " combined=", combined_kv ? 1 : 0,
                      " page_tokens=", page_tokens, " bytes_per_token=", bytes_per_token,
                      " pages=", pages);
}

absl::StatusOr<KvLayout> KvLayout::Decode(absl::string_view text) {
  std::vector<absl::string_view> fields = absl::StrSplit(text, ' ');
  KvLayout l;
  uint32_t combined = 0;
  bool ok = fields.size() == 6 && fields[0] == "kv1";
  for (size_t i = 1; ok && i < fields.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(fields[i], '=');
    if (kv.first == "layers") ok = absl::SimpleAtoi(kv.second, &l.layers);
    else if (kv.first == "combined") ok = absl::SimpleAtoi(kv.second, &combined);
    else if (kv.first == "page_tokens") ok = absl::SimpleAtoi(kv.second, &l.page_tokens);
    else if (kv.first == "bytes_per_token") ok = absl::SimpleAtoi(kv.second, &l.bytes_per_token);
    else if (kv.first == "pages") ok = absl::SimpleAtoi(kv.second, &l.pages);
    else ok = false;
  }
  if (!ok) return absl::DataLossError(absl::StrCat("malformed KV layout '", text, "'"));
  l.combined_kv = combined != 0;
  RETURN_IF_ERROR(l.Validate());
  return l;
}

// ---------------------------------------------------------------- pool

absl::StatusOr<KvPool> KvPool::Allocate(const KvLayout& layout) {
  RETURN_IF_ERROR(layout.Validate());
  const uint64_t total = layout.buffer_bytes() * layout.buffer_count();
  char* memory = static_cast<char*>(std::calloc(total, 1));
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate a KV pool of ", total,
                                                     " bytes"));
  }
  KvPool pool;
  pool.layout_ = layout;
  pool.storage_ = std::shared_ptr<char>(memory, [](char* p) { std::free(p); });
  for (uint32_t b = 0; b < layout.buffer_count(); ++b) {
    pool.buffers_.push_back(memory + b * layout.buffer_bytes());
  }
  return pool;
}

absl::StatusOr<KvPool> KvPool::Wrap(const KvLayout& layout, std::vector<void*> buffers) {
  RETURN_IF_ERROR(layout.Validate());
  if (buffers.size() != layout.buffer_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a layout of ", layout.layers, " layers needs ", layout.buffer_count(),
        " buffers; got ", buffers.size()));
  }
  for (void* b : buffers) {
    if (b == nullptr) return absl::InvalidArgumentError("null KV buffer");
  }
  KvPool pool;
  pool.layout_ = layout;
  pool.buffers_ = std::move(buffers);
  return pool;
}

absl::Status KvPool::Register(TransferEngine& engine, transport::Access access) const {
  if (contiguous()) {
    return engine.RegisterMemory(buffers_[0], layout_.buffer_bytes() * layout_.buffer_count(),
                                 access);
  }
  for (void* b : buffers_) RETURN_IF_ERROR(engine.RegisterMemory(b, layout_.buffer_bytes(), access));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- coalescing

absl::StatusOr<std::vector<PageRun>> CoalescePages(absl::Span<const uint32_t> src,
                                                   absl::Span<const uint32_t> dst) {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        src.size(), " source pages but ", dst.size(), " destination pages"));
  }
  // Pages on one diagonal (dst - src) with consecutive dst form a run; with
  // unique destinations each page has at most one successor, so grouping by
  // diagonal and merging consecutive destinations gives the fewest runs.
  std::vector<std::pair<uint32_t, uint32_t>> pairs;  // (dst, src)
  pairs.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) pairs.emplace_back(dst[i], src[i]);
  std::sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) {
    const int64_t da = int64_t{a.first} - a.second, db = int64_t{b.first} - b.second;
    return da != db ? da < db : a.first < b.first;
  });
  std::vector<PageRun> runs;
  std::vector<uint32_t> seen_dst;
  seen_dst.reserve(pairs.size());
  for (const auto& [d, s] : pairs) {
    seen_dst.push_back(d);
    if (!runs.empty()) {
      PageRun& last = runs.back();
      if (uint64_t{last.dst} + last.count == d && uint64_t{last.src} + last.count == s) {
        ++last.count;
        continue;
      }
    }
    runs.push_back(PageRun{s, d, 1});
  }
  std::sort(seen_dst.begin(), seen_dst.end());
  auto dup = std::adjacent_find(seen_dst.begin(), seen_dst.end());
  if (dup != seen_dst.end()) {
    return absl::InvalidArgumentError(absl::StrCat("destination page ", *dup, " appears twice"));
  }
  std::sort(runs.begin(), runs.end(),
            [](const PageRun& a, const PageRun& b) { return a.src < b.src; });
  return runs;
}

// ---------------------------------------------------------------- sender

absl::StatusOr<std::unique_ptr<KvSender>> KvSender::Create(TransferEngine* engine, KvPool pool,
                                                          Options options) {
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
    // request will not come, as it would be of a failure later.
    (void)Say([&]() -> absl::StatusOr<SegmentId> { return engine_->OpenSegment(peer); }, 0,
              KvMessage("fail", request_id, NewToken(),
                        absl::StrCat("not started: ", r.status().message())));
    return r.status();
  }
  (*r)->token = NewToken();
  MutexLock lock(&mu_);
  const Handle h = ++last_;
  requests_[h] = std::move(*r);
  return h;
}

absl::StatusOr<std::unique_ptr<KvSender::Request>> KvSender::Prepare(
    const std::string& request_id, const std::string& peer, absl::Span<const uint32_t> src_pages,
    absl::Span<const uint32_t> dst_pages) {
  const KvLayout& mine = pool_.layout();
  ASSIGN_OR_RETURN(std::vector<PageRun> runs, CoalescePages(src_pages, dst_pages));
  if (options_.checksums && dst_pages.size() > kMaxChecksumPages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV request ", request_id, ": ", dst_pages.size(), " pages; with checksums at most ",
        kMaxChecksumPages, " per request"));
  }
  ASSIGN_OR_RETURN(SegmentId segment, engine_->OpenSegment(peer));
  ASSIGN_OR_RETURN(std::string published, engine_->FetchMetadata(segment, kKvPoolMetadataKey));
  // The instance the pool description came from (FetchMetadata matched it
  // to the segment's last handshake).
  ASSIGN_OR_RETURN(const uint64_t instance, engine_->PeerEngineId(segment));
  std::pair<std::string, std::string> lines = absl::StrSplit(published, '\n');
  ASSIGN_OR_RETURN(KvLayout theirs, KvLayout::Decode(lines.first));
  if (theirs.layers != mine.layers || theirs.combined_kv != mine.combined_kv ||
      theirs.page_bytes() != mine.page_bytes()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the KV pool at ", peer, " (", theirs.Encode(), ") does not match this one (",
        mine.Encode(), ")"));
  }
  auto r = std::make_unique<Request>();
  for (absl::string_view a : absl::StrSplit(lines.second, ',', absl::SkipEmpty())) {
    uint64_t addr;
    if (!absl::SimpleHexAtoi(a, &addr)) return absl::DataLossError("malformed KV pool buffers");
    r->remote_buffers.push_back(reinterpret_cast<void*>(addr));
  }
  if (r->remote_buffers.size() != theirs.buffer_count()) {
    return absl::DataLossError("the peer's KV pool lists the wrong number of buffers");
  }
  for (const PageRun& run : runs) {
    if (uint64_t{run.src} + run.count > mine.pages || uint64_t{run.dst} + run.count > theirs.pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", request_id, ": page run ", run.src, "->", run.dst, " x", run.count,
          " falls outside the pools (", mine.pages, " local, ", theirs.pages, " remote pages)"));
    }
  }
  r->id = request_id;
  r->segment = segment;
  r->peer_engine_id = instance;
  r->runs = std::move(runs);
  r->sent.assign(mine.layers, false);
  return r;
}

absl::Status KvSender::SendLayer(Handle h, uint32_t layer) {
  std::vector<TransferRequest> transfers;
  SegmentId segment;
  uint64_t peer_engine_id;
  {
    MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Request * r, Find(h));
    if (layer >= pool_.layout().layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " of ",
                                                     pool_.layout().layers));
    }
    if (r->sent[layer]) return absl::OkStatus();
    r->sent[layer] = true;
    const KvLayout& l = pool_.layout();
    for (uint32_t kv = 0; kv < l.buffers_per_layer(); ++kv) {
      const uint32_t b = layer * l.buffers_per_layer() + kv;
      for (const PageRun& run : r->runs) {
        transfers.push_back({transport::Opcode::kWrite, pool_.page(layer, kv, run.src),
                             reinterpret_cast<uintptr_t>(r->remote_buffers[b]) +
                                 uint64_t{run.dst} * l.page_bytes(),
                             uint64_t{run.count} * l.page_bytes()});
      }
    }
    segment = r->segment;
    peer_engine_id = r->peer_engine_id;
  }
  // Bound to the decode instance whose pool the addresses describe: after a
  // restart they would land in whatever its successor keeps there.
  absl::StatusOr<BatchId> batch = engine_->Submit(segment, transfers, peer_engine_id);
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
    absl::Status told = seg.ok() ? engine_->Notify(*seg, message, instance) : seg.status();
    const bool passing = told.code() == absl::StatusCode::kUnavailable ||
                         told.code() == absl::StatusCode::kDeadlineExceeded;
    if (told.ok() || !passing || clock->Now() + pause >= deadline) return told;
    clock->SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(100));
  }
}

absl::Status KvSender::Finish(Handle h, const std::string& aux) {
  if (aux.size() > kMaxAuxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("aux payload of ", aux.size(),
                                                   " bytes exceeds ", kMaxAuxBytes));
  }
  (void)SendAll(h);  // a failure is recorded in the request
  std::unique_ptr<Request> r;
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(h);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("unknown KV request ", h));
    r = std::move(it->second);
    requests_.erase(it);
  }
  bool uncertain = false;
  absl::Status data = Drain(*r, &uncertain);
  if (!data.ok()) {
    (void)Tell(*r, KvMessage(uncertain ? "abrt" : "fail", r->id, r->token, data.message()));
    return Annotate(data, absl::StrCat("KV request ", r->id));
  }
  if (options_.checksums) {
    return Tell(*r, KvMessage("donc", r->id, r->token, ChecksummedBody(pool_, r->runs, aux)));
  }
  return Tell(*r, KvMessage("done", r->id, r->token, aux));
}

absl::Status KvSender::Cancel(Handle h, const std::string& reason) {
  std::unique_ptr<Request> r;
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(h);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("unknown KV request ", h));
    r = std::move(it->second);
    requests_.erase(it);
  }
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

// ---------------------------------------------------------------- receiver

absl::StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::Create(TransferEngine* engine,
                                                              KvPool pool, Options options) {
  if (options.peer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("KvReceiver: peer_timeout must be positive");
  }
  RETURN_IF_ERROR(pool.Register(*engine, transport::Access::kRemoteWrite));
  std::vector<std::string> addrs;
  for (uint32_t b = 0; b < pool.layout().buffer_count(); ++b) {
    addrs.push_back(absl::StrFormat("%x", reinterpret_cast<uintptr_t>(pool.buffer(b))));
  }
  RETURN_IF_ERROR(engine->PublishMetadata(
      kKvPoolMetadataKey, absl::StrCat(pool.layout().Encode(), "\n", absl::StrJoin(addrs, ","))));
  return std::unique_ptr<KvReceiver>(new KvReceiver(engine, std::move(pool), options));
}

KvReceiver::~KvReceiver() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
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
  if (!watched && instance == 0) {
    absl::StatusOr<uint64_t> id = engine_->ProbePeer(peer, options_.peer_timeout / 4);
    if (id.ok()) instance = *id;
  }
  const absl::Time now = engine_->clock()->Now();
  bool start = false;
  {
    MutexLock lock(&mu_);
    Status& s = requests_[request_id];
    // Its word came first (the prefill was quicker than this call): there
    // is nothing left to watch.
    if (s.state != State::kPending) return absl::OkStatus();
    if (auto again = expected_.find(request_id); again != expected_.end()) Unexpect(again);
    auto [known, fresh] =
        prefills_.try_emplace(peer, Prefill{instance, now, now + options_.peer_timeout / 4});
    if (!fresh && prefill_engine_id != 0 && known->second.engine_id == 0) {
      known->second.engine_id = prefill_engine_id;
    }
    ++known->second.expected;
    expected_[request_id] = peer;
    start = !watcher_started_ && engine_->clock() == RealClock();
    watcher_started_ = watcher_started_ || start;
    changed_.SignalAll();
  }
  if (start) {
    absl::StatusOr<std::thread> t = StartThread("a KV receiver's prefill watcher", [this] { Watch(); });
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
      changed_.WaitWithTimeout(&mu_, std::min(wait, absl::Hours(1)));
      continue;
    }
    mu_.Unlock();
    CheckPrefills();
    mu_.Lock();
  }
  mu_.Unlock();
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
  for (const auto& [peer, p] : due) {
    const absl::Time start = clock->Now();
    absl::StatusOr<uint64_t> id = engine_->ProbePeer(peer, period);
    const absl::Time now = clock->Now();
    absl::Status dead;
    if (id.ok() && engine_->PeerFenced(*id)) {
      // Declared failed earlier (and still running): it can deliver nothing
      // here until it restarts.
      dead = absl::UnavailableError(absl::StrFormat(
          "the prefill at %s (engine %#x) was declared failed earlier and is fenced off this "
          "engine; it must restart",
          peer, *id));
    } else if (id.ok() && p.engine_id != 0 && *id != p.engine_id) {
      dead = absl::UnavailableError(absl::StrFormat(
          "the prefill at %s restarted (engine %#x, now %#x): its requests were lost", peer,
          p.engine_id, *id));
    } else if (!id.ok() && now - p.last_answer >= options_.peer_timeout - period) {
      dead = absl::UnavailableError(absl::StrCat(
          "the prefill at ", peer, " has not answered for ",
          absl::FormatDuration(absl::Trunc(now - p.last_answer, absl::Milliseconds(1))), " (",
          id.status().message(), ")"));
    }
    // Fenced before anyone is told: nothing of it lands afterwards.
    if (!dead.ok() && p.engine_id != 0) engine_->FencePeer(p.engine_id);
    MutexLock lock(&mu_);
    auto it = prefills_.find(peer);
    if (it == prefills_.end()) continue;
    if (!dead.ok()) {
      FailFrom(peer, dead);  // forgets the prefill with its last request
      continue;
    }
    if (id.ok()) {
      it->second.engine_id = *id;
      it->second.last_answer = now;
    }
    it->second.next_probe = start + period;
  }
}

void KvReceiver::FailFrom(const std::string& prefill, const absl::Status& why) {
  // What arrived before the fence counts: a request whose completion is
  // already here is complete.
  Absorb(engine_->TakeNotifications());
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
  if (p != prefills_.end() && --p->second.expected == 0) prefills_.erase(p);
  expected_.erase(e);
}

void KvReceiver::Absorb(std::vector<Notification> notes) {
  for (Notification& n : notes) {
    const std::optional<Word> w = ParseWord(n.message);
    if (!w.has_value()) {
      others_.push_back(std::move(n));
      continue;
    }
    const std::string id(w->id);
    // A word about an attempt whose request was finished and forgotten (said
    // again after a lost reply, or late): not about what is expected now.
    if (w->token != 0 && retired_.Contains({id, w->token})) {
      ++ignored_words_;
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
      Unexpect(e);
    }
    Status& s = requests_[id];
    if (s.state != State::kPending) continue;  // first word wins
    if (w->token != 0) tokens_[id] = w->token;
    if (w->kind == "done") {
      s.state = State::kComplete;
      s.aux = std::string(w->body);
    } else if (w->kind == "donc") {
      absl::StatusOr<std::string> aux = Verify(id, w->body);
      s.state = aux.ok() ? State::kComplete : State::kFailed;
      if (aux.ok()) {
        s.aux = std::move(*aux);
      } else {
        s.error = aux.status();
      }
    } else {
      // A write the sender gave up on may still be on its way: its links
      // are dropped first, so nothing of it lands after this report.
      if (w->kind == "abrt") engine_->DropLinksFrom(n.engine_id);
      s.state = State::kFailed;
      s.error = absl::AbortedError(absl::StrCat("the sender failed the request: ", w->body));
    }
  }
}

KvReceiver::Status KvReceiver::Poll(const std::string& request_id) {
  std::vector<Notification> notes = engine_->TakeNotifications();
  MutexLock lock(&mu_);
  Absorb(std::move(notes));
  auto it = requests_.find(request_id);
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
  for (;;) {
    Absorb(engine_->TakeNotifications());
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
    absl::StatusOr<Notification> n = engine_->WaitNotification(std::min(left, kSlice));
    mu_.Lock();
    pumping_ = false;
    if (n.ok()) Absorb({std::move(*n)});
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
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i) {
      uint32_t want = 0;
      if (!GetU32(&body, &want)) return malformed();
      const uint32_t got = PageCrc(pool_, r.dst + i);
      if (got != want) {
        ++checksum_failures_;
        return absl::DataLossError(absl::StrFormat(
            "KV request %s: page %u differs from what the sender sent (CRC-32C %08x, expected "
            "%08x): corrupted in transit",
            request_id, r.dst + i, got, want));
      }
    }
  }
  return std::string(body);
}

uint64_t KvReceiver::ignored_words() const {
  MutexLock lock(&mu_);
  return ignored_words_;
}

uint64_t KvReceiver::checksum_failures() const {
  MutexLock lock(&mu_);
  return checksum_failures_;
}

void KvReceiver::Forget(const std::string& request_id) {
  MutexLock lock(&mu_);
  requests_.erase(request_id);
  if (auto t = tokens_.find(request_id); t != tokens_.end()) {
    // Its attempt's words are ignored from now on (the id may come again).
    retired_.Insert({request_id, t->second});
    tokens_.erase(t);
  }
  if (auto e = expected_.find(request_id); e != expected_.end()) Unexpect(e);
}

std::vector<Notification> KvReceiver::TakeOtherNotifications() {
  std::vector<Notification> notes = engine_->TakeNotifications();
  MutexLock lock(&mu_);
  Absorb(std::move(notes));
  return std::exchange(others_, {});
}

}  // namespace kvferry
