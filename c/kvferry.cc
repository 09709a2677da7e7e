// kvferry's C API over the C++ engine (c/kvferry.h). Each function turns
// its arguments into the C++ types, calls the engine and turns the
// absl::Status into a code plus this thread's last error. No C++ exception
// or type crosses the boundary.
#include "c/kvferry.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "kv/kv_cache.h"
#include "engine/metrics.h"
#include "engine/transfer_engine.h"
#include "transport/verbs/discovery.h"

#ifndef KVFERRY_VERSION
#define KVFERRY_VERSION "0.0.0"
#endif

struct kvferry_options {
  kvferry::EngineOptions o;
};

struct kvferry_engine {
  std::unique_ptr<kvferry::TransferEngine> engine;
  std::string address;
  std::string metrics_address;
  kvferry::Detection detection;
  kvferry::Mutex mu;
  // Notifications taken from the engine and not handed out yet.
  std::deque<kvferry::Notification> notes ABSL_GUARDED_BY(mu);
  // kvferry_transfer_sync batches that outlived their timeout: each later
  // call releases those that finished (so none stays in the engine).
  std::vector<kvferry::BatchId> abandoned ABSL_GUARDED_BY(mu);
};

struct kvferry_kv_pool {
  kvferry::KvPool pool;
};

struct kvferry_kv_sender {
  std::unique_ptr<kvferry::KvSender> sender;
};

struct kvferry_kv_receiver {
  std::unique_ptr<kvferry::KvReceiver> receiver;
};

namespace kvferry {
namespace {

thread_local std::string last_error;

int Ok() {
  last_error.clear();
  return KVFERRY_OK;
}

int Fail(const absl::Status& s) {
  if (s.ok()) return Ok();
  last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

int Result(const absl::Status& s) { return s.ok() ? Ok() : Fail(s); }

int Invalid(absl::string_view what) { return Fail(absl::InvalidArgumentError(what)); }

absl::Duration Millis(int64_t ms) { return absl::Milliseconds(ms < 0 ? 0 : ms); }

// Copies `bytes` into memory kvferry_free releases.
int Give(absl::string_view bytes, char** out, size_t* length) {
  if (out == nullptr) return Invalid("null output pointer");
  char* p = static_cast<char*>(std::malloc(bytes.size() + 1));
  if (p == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  std::memcpy(p, bytes.data(), bytes.size());
  p[bytes.size()] = '\0';
  *out = p;
  if (length != nullptr) *length = bytes.size();
  return Ok();
}

absl::Status ParseInt(const char* key, const char* value, int64_t lo, int64_t hi, int64_t* out) {
  if (!absl::SimpleAtoi(value, out) || *out < lo || *out > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("option ", key, "='", value, "': an integer from ", lo, " to ", hi));
  }
  return absl::OkStatus();
}

absl::Status SetOption(EngineOptions& o, const std::string& key, const char* value) {
  int64_t v = 0;
  auto integer = [&](int64_t lo, int64_t hi) { return ParseInt(key.c_str(), value, lo, hi, &v); };
  auto millis = [&](absl::Duration* d) {
    absl::Status s = integer(0, int64_t{1} << 40);
    if (s.ok()) *d = absl::Milliseconds(v);
    return s;
  };
  if (key == "local_host") {
    o.local_host = value;
  } else if (key == "bind_host") {
    o.bind_host = value;
  } else if (key == "transport") {
    o.transport = value;
  } else if (key == "secret") {
    o.secret = value;
  } else if (key == "metrics_host") {
    o.metrics_host = value;
  } else if (key == "devices") {
    o.devices.clear();
    for (absl::string_view d : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
      o.devices.emplace_back(absl::StripAsciiWhitespace(d));
    }
  } else if (key == "port" || key == "first_port" || key == "last_port") {
    RETURN_IF_ERROR(integer(key == "port" ? 0 : 1, 65535));
    (key == "port"         ? o.port
     : key == "first_port" ? o.first_port
                           : o.last_port) = static_cast<uint16_t>(v);
  } else if (key == "gid_index") {
    RETURN_IF_ERROR(integer(-1, 65535));
    o.gid_index = static_cast<int>(v);
  } else if (key == "slice_bytes") {
    RETURN_IF_ERROR(integer(0, int64_t{1} << 40));
    o.slice_bytes = static_cast<uint64_t>(v);
  } else if (key == "links_per_peer") {
    RETURN_IF_ERROR(integer(0, 1024));
    o.links_per_peer = static_cast<uint32_t>(v);
  } else if (key == "retries") {
    RETURN_IF_ERROR(integer(0, 1000));
    o.retries = static_cast<uint32_t>(v);
  } else if (key == "metrics_port") {
    RETURN_IF_ERROR(integer(-1, 65535));
    o.metrics_port = static_cast<int>(v);
  } else if (key == "connect_timeout_ms") {
    return millis(&o.connect_timeout);
  } else if (key == "handshake_timeout_ms") {
    return millis(&o.handshake_timeout);
  } else if (key == "peer_timeout_ms") {
    return millis(&o.peer_timeout);
  } else if (key == "idle_segment_timeout_ms") {
    return millis(&o.idle_segment_timeout);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown option '", key, "'"));
  }
  return absl::OkStatus();
}

// The first request that failed (a pending one reads kUnavailable
// "pending", see BatchStatus), or -1.
int64_t FirstFailed(const BatchStatus& st) {
  if (st.failed == 0) return -1;
  for (size_t i = 0; i < st.requests.size(); ++i) {
    const absl::Status& s = st.requests[i];
    if (!s.ok() && !(s.code() == absl::StatusCode::kUnavailable && s.message() == "pending")) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

// Fills `out` (may be null) and returns OK when every request succeeded;
// else the first failure, or DEADLINE_EXCEEDED while some are pending (when
// `pending_is_error`).
int Outcome(const BatchStatus& st, bool pending_is_error, kvferry_batch_status* out) {
  const int64_t first = FirstFailed(st);
  if (out != nullptr) {
    *out = kvferry_batch_status{};
    out->pending = st.pending;
    out->succeeded = st.succeeded;
    out->failed = st.failed;
    if (first >= 0) {
      out->first_error = static_cast<int32_t>(st.requests[first].code());
      out->first_failed = static_cast<uint64_t>(first);
    }
  }
  if (first >= 0) {
    const absl::Status& s = st.requests[first];
    return Fail(absl::Status(s.code(), absl::StrCat("request ", first, ": ", s.message())));
  }
  if (st.pending > 0 && pending_is_error) {
    return Fail(absl::DeadlineExceededError(
        absl::StrCat(st.pending, " of ", st.requests.size(), " requests still pending")));
  }
  return Ok();
}

void ReleaseAbandoned(kvferry_engine& e) {
  MutexLock lock(&e.mu);
  auto& v = e.abandoned;
  v.erase(std::remove_if(v.begin(), v.end(), [&](BatchId b) { return e.engine->Release(b).ok(); }),
          v.end());
}

absl::StatusOr<std::vector<TransferRequest>> Columns(int opcode, const uint64_t* local,
                                                     const uint64_t* remote,
                                                     const uint64_t* lengths, size_t count) {
  if (opcode != KVFERRY_OP_WRITE && opcode != KVFERRY_OP_READ) {
    return absl::InvalidArgumentError(absl::StrCat("opcode ", opcode, ": write (0) or read (1)"));
  }
  if (count > 0 && (local == nullptr || remote == nullptr || lengths == nullptr)) {
    return absl::InvalidArgumentError("null request array");
  }
  std::vector<TransferRequest> reqs(count);
  const auto op = opcode == KVFERRY_OP_WRITE ? transport::Opcode::kWrite : transport::Opcode::kRead;
  for (size_t i = 0; i < count; ++i) {
    reqs[i] = TransferRequest{op, reinterpret_cast<void*>(local[i]), remote[i], lengths[i]};
  }
  return reqs;
}

absl::StatusOr<KvLayout> Layout(const kvferry_kv_layout* l) {
  if (l == nullptr) return absl::InvalidArgumentError("null layout");
  KvLayout out{l->layers, l->combined_kv != 0, l->page_tokens, l->bytes_per_token, l->pages};
  RETURN_IF_ERROR(out.Validate());
  return out;
}

void JsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(out, absl::StrFormat("\\u%04x", c));
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

void JsonCounts(std::string* out, const std::map<std::string, uint64_t>& m) {
  out->push_back('{');
  bool first = true;
  for (const auto& [k, v] : m) {
    if (!first) out->append(", ");
    first = false;
    JsonString(out, k);
    absl::StrAppend(out, ": ", v);
  }
  out->push_back('}');
}

std::string MetricsJson(const EngineMetrics& m) {
  std::string out = "{\"peers\": [";
  for (size_t i = 0; i < m.peers.size(); ++i) {
    const PeerMetrics& p = m.peers[i];
    if (i > 0) out.append(", ");
    out.append("{\"peer\": ");
    JsonString(&out, p.peer);
    absl::StrAppend(&out, ", \"requests\": ", p.requests, ", \"requests_ok\": ", p.requests_ok,
                    ", \"bytes_written\": ", p.bytes_written, ", \"bytes_read\": ", p.bytes_read,
                    ", \"slices\": ", p.slices, ", \"retries\": ", p.retries,
                    ", \"reconnects\": ", p.reconnects, ", \"errors\": ");
    JsonCounts(&out, p.errors);
    absl::StrAppend(&out, ", \"latency_p50_s\": ", p.latency.QuantileBound(0.5),
                    ", \"latency_p99_s\": ", p.latency.QuantileBound(0.99), "}");
  }
  out.append("], \"nics\": [");
  for (size_t i = 0; i < m.nics.size(); ++i) {
    const NicMetrics& n = m.nics[i];
    if (i > 0) out.append(", ");
    out.append("{\"name\": ");
    JsonString(&out, n.name);
    absl::StrAppend(&out, ", \"slices\": ", n.slices, ", \"bytes\": ", n.bytes,
                    ", \"errors\": ", n.errors, ", \"errors_by_code\": ");
    JsonCounts(&out, n.errors_by_code);
    absl::StrAppend(&out, ", \"retries\": ", n.retries, "}");
  }
  out.append("]}");
  return out;
}

}  // namespace
}  // namespace kvferry

using kvferry::Fail;
using kvferry::Invalid;
using kvferry::Ok;
using kvferry::Result;

#define KVF_REQUIRE(cond, what)        \
  do {                                 \
    if (!(cond)) return Invalid(what); \
  } while (0)

extern "C" {

uint32_t kvferry_api_version(void) { return KVFERRY_C_API_VERSION; }
const char* kvferry_version(void) { return KVFERRY_VERSION; }
const char* kvferry_last_error(void) { return kvferry::last_error.c_str(); }
void kvferry_free(void* p) { std::free(p); }

const char* kvferry_status_name(int status) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  return status >= 0 && status <= 16 ? kNames[status] : "UNKNOWN";
}

kvferry_options* kvferry_options_new(void) { return new (std::nothrow) kvferry_options(); }
void kvferry_options_free(kvferry_options* options) { delete options; }

int kvferry_options_set(kvferry_options* options, const char* key, const char* value) {
  KVF_REQUIRE(options != nullptr && key != nullptr && value != nullptr, "null argument");
  return Result(kvferry::SetOption(options->o, key, value));
}

int kvferry_engine_create(const kvferry_options* options, kvferry_engine** out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  *out = nullptr;
  auto e =
      kvferry::TransferEngine::Create(options != nullptr ? options->o : kvferry::EngineOptions());
  if (!e.ok()) return Fail(e.status());
  auto* h = new kvferry_engine();
  h->engine = std::move(*e);
  h->address = h->engine->address();
  h->metrics_address = h->engine->metrics_address();
  h->detection = h->engine->detection();
  *out = h;
  return Ok();
}

void kvferry_engine_destroy(kvferry_engine* engine) { delete engine; }
const char* kvferry_engine_address(const kvferry_engine* e) { return e->address.c_str(); }
uint64_t kvferry_engine_id(const kvferry_engine* e) { return e->engine->engine_id(); }
const char* kvferry_engine_metrics_address(const kvferry_engine* e) {
  return e->metrics_address.c_str();
}

const char* kvferry_engine_detection(const kvferry_engine* e, const char* key) {
  if (key == nullptr) return nullptr;
  const absl::string_view k(key);
  const kvferry::Detection& d = e->detection;
  if (k == "host") return d.host.c_str();
  if (k == "host_reason") return d.host_reason.c_str();
  if (k == "bind_host") return d.bind_host.c_str();
  if (k == "transport") return d.transport.c_str();
  if (k == "transport_reason") return d.transport_reason.c_str();
  if (k == "devices") return d.devices.c_str();
  return nullptr;
}

int kvferry_register_memory(kvferry_engine* e, void* addr, uint64_t length, int access,
                            const char* location) {
  KVF_REQUIRE(access >= KVFERRY_ACCESS_NONE && access <= KVFERRY_ACCESS_READ_WRITE,
              absl::StrCat("access ", access, ": 0 none, 1 read, 2 write or 3 read-write"));
  return Result(e->engine->RegisterMemory(addr, length,
                                          static_cast<kvferry::transport::Access>(access),
                                          location != nullptr ? location : ""));
}

int kvferry_unregister_memory(kvferry_engine* e, void* addr) {
  return Result(e->engine->UnregisterMemory(addr));
}

int kvferry_open_segment(kvferry_engine* e, const char* peer, kvferry_segment* out) {
  KVF_REQUIRE(peer != nullptr && out != nullptr, "null argument");
  auto seg = e->engine->OpenSegment(peer);
  if (!seg.ok()) return Fail(seg.status());
  *out = *seg;
  return Ok();
}

int kvferry_close_segment(kvferry_engine* e, kvferry_segment segment) {
  return Result(e->engine->CloseSegment(segment));
}

int kvferry_segment_regions(kvferry_engine* e, kvferry_segment segment, kvferry_region* out,
                            size_t capacity, size_t* count) {
  KVF_REQUIRE(count != nullptr && (out != nullptr || capacity == 0), "null argument");
  auto regions = e->engine->SegmentRegions(segment);
  if (!regions.ok()) return Fail(regions.status());
  *count = regions->size();
  for (size_t i = 0; i < regions->size() && i < capacity; ++i) {
    out[i] = kvferry_region{(*regions)[i].addr, (*regions)[i].length,
                            static_cast<int32_t>((*regions)[i].access)};
  }
  return Ok();
}

int kvferry_segment_engine_id(kvferry_engine* e, kvferry_segment segment, uint64_t* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto id = e->engine->PeerEngineId(segment);
  if (!id.ok()) return Fail(id.status());
  *out = *id;
  return Ok();
}

int kvferry_submit(kvferry_engine* e, kvferry_segment segment, const kvferry_request* requests,
                   size_t count, uint64_t peer_engine_id, kvferry_batch* out) {
  KVF_REQUIRE(out != nullptr && (requests != nullptr || count == 0), "null argument");
  std::vector<kvferry::TransferRequest> reqs(count);
  for (size_t i = 0; i < count; ++i) {
    const int op = requests[i].opcode;
    KVF_REQUIRE(op == KVFERRY_OP_WRITE || op == KVFERRY_OP_READ,
                absl::StrCat("request ", i, ": opcode ", op, ": write (0) or read (1)"));
    reqs[i] = kvferry::TransferRequest{op == KVFERRY_OP_WRITE ? kvferry::transport::Opcode::kWrite
                                                              : kvferry::transport::Opcode::kRead,
                                       requests[i].local, requests[i].remote, requests[i].length};
  }
  auto batch = e->engine->Submit(segment, reqs, peer_engine_id);
  if (!batch.ok()) return Fail(batch.status());
  *out = *batch;
  return Ok();
}

int kvferry_submit_columns(kvferry_engine* e, kvferry_segment segment, int opcode,
                           const uint64_t* local, const uint64_t* remote, const uint64_t* lengths,
                           size_t count, uint64_t peer_engine_id, kvferry_batch* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto reqs = kvferry::Columns(opcode, local, remote, lengths, count);
  if (!reqs.ok()) return Fail(reqs.status());
  auto batch = e->engine->Submit(segment, *reqs, peer_engine_id);
  if (!batch.ok()) return Fail(batch.status());
  *out = *batch;
  return Ok();
}

int kvferry_poll(kvferry_engine* e, kvferry_batch batch, kvferry_batch_status* out) {
  auto st = e->engine->Poll(batch);
  if (!st.ok()) return Fail(st.status());
  return kvferry::Outcome(*st, /*pending_is_error=*/false, out);
}

int kvferry_wait(kvferry_engine* e, kvferry_batch batch, int64_t timeout_ms,
                 kvferry_batch_status* out) {
  auto st = e->engine->Wait(batch, kvferry::Millis(timeout_ms));
  if (!st.ok()) return Fail(st.status());
  return kvferry::Outcome(*st, /*pending_is_error=*/true, out);
}

int kvferry_release(kvferry_engine* e, kvferry_batch batch) {
  return Result(e->engine->Release(batch));
}

int kvferry_transfer_sync(kvferry_engine* e, const char* peer, int opcode, const uint64_t* local,
                          const uint64_t* remote, const uint64_t* lengths, size_t count,
                          int64_t timeout_ms) {
  KVF_REQUIRE(peer != nullptr, "null peer");
  auto reqs = kvferry::Columns(opcode, local, remote, lengths, count);
  if (!reqs.ok()) return Fail(reqs.status());
  kvferry::ReleaseAbandoned(*e);
  auto seg = e->engine->OpenSegment(peer);
  if (!seg.ok()) return Fail(seg.status());
  auto batch = e->engine->Submit(*seg, *reqs);
  if (!batch.ok()) return Fail(batch.status());
  auto st = e->engine->Wait(*batch, kvferry::Millis(timeout_ms));
  if (!st.ok()) return Fail(st.status());
  if (!e->engine->Release(*batch).ok()) {
    // Still running past the timeout: released by a later call once done.
    kvferry::MutexLock lock(&e->mu);
    e->abandoned.push_back(*batch);
  }
  return kvferry::Outcome(*st, /*pending_is_error=*/true, nullptr);
}

int kvferry_submit_on_stream(kvferry_engine* e, kvferry_segment segment, int opcode,
                             const uint64_t* local, const uint64_t* remote, const uint64_t* lengths,
                             size_t count, void* stream, int hold_stream, int64_t timeout_ms,
                             int keep_result, uint64_t* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto reqs = kvferry::Columns(opcode, local, remote, lengths, count);
  if (!reqs.ok()) return Fail(reqs.status());
  kvferry::StreamOptions o;
  o.hold_stream = hold_stream != 0;
  o.timeout = kvferry::Millis(timeout_ms);
  o.keep_result = keep_result != 0;
  auto id = e->engine->SubmitOnStream(segment, *reqs, stream, o);
  if (!id.ok()) return Fail(id.status());
  *out = *id;
  return Ok();
}

int kvferry_wait_on_stream(kvferry_engine* e, uint64_t id, int64_t timeout_ms,
                           kvferry_batch_status* out) {
  auto st = e->engine->WaitOnStream(id, kvferry::Millis(timeout_ms));
  if (!st.ok()) return Fail(st.status());
  return kvferry::Outcome(*st, /*pending_is_error=*/true, out);
}

int kvferry_notify(kvferry_engine* e, kvferry_segment segment, const void* message, size_t length,
                   uint64_t peer_engine_id) {
  KVF_REQUIRE(message != nullptr || length == 0, "null message");
  return Result(e->engine->Notify(segment, std::string(static_cast<const char*>(message), length),
                                  peer_engine_id));
}

int kvferry_notify_after(kvferry_engine* e, kvferry_batch batch, const void* message, size_t length,
                         int64_t timeout_ms) {
  KVF_REQUIRE(message != nullptr || length == 0, "null message");
  return Result(e->engine->NotifyAfter(
      batch, std::string(static_cast<const char*>(message), length), kvferry::Millis(timeout_ms)));
}

int kvferry_next_notification(kvferry_engine* e, int64_t timeout_ms, uint64_t* sender,
                              char** message, size_t* length) {
  KVF_REQUIRE(sender != nullptr && message != nullptr && length != nullptr, "null argument");
  kvferry::Notification n;
  bool have = false;
  {
    kvferry::MutexLock lock(&e->mu);
    if (e->notes.empty()) {
      for (kvferry::Notification& t : e->engine->TakeNotifications()) {
        e->notes.push_back(std::move(t));
      }
    }
    if (!e->notes.empty()) {
      n = std::move(e->notes.front());
      e->notes.pop_front();
      have = true;
    }
  }
  if (!have) {
    if (timeout_ms <= 0) {
      return Fail(absl::DeadlineExceededError("no notification"));
    }
    auto got = e->engine->WaitNotification(kvferry::Millis(timeout_ms));
    if (!got.ok()) return Fail(got.status());
    n = std::move(*got);
  }
  *sender = n.engine_id;
  return kvferry::Give(n.message, message, length);
}

int kvferry_publish_metadata(kvferry_engine* e, const char* key, const void* value, size_t length) {
  KVF_REQUIRE(key != nullptr && (value != nullptr || length == 0), "null argument");
  return Result(
      e->engine->PublishMetadata(key, std::string(static_cast<const char*>(value), length)));
}

int kvferry_fetch_metadata(kvferry_engine* e, kvferry_segment segment, const char* key,
                           char** value, size_t* length) {
  KVF_REQUIRE(key != nullptr, "null key");
  auto v = e->engine->FetchMetadata(segment, key);
  if (!v.ok()) return Fail(v.status());
  return kvferry::Give(*v, value, length);
}

int kvferry_probe(kvferry_engine* e, const char* peer, int64_t timeout_ms, uint64_t* out) {
  KVF_REQUIRE(peer != nullptr && out != nullptr, "null argument");
  auto id = e->engine->ProbePeer(peer, kvferry::Millis(timeout_ms));
  if (!id.ok()) return Fail(id.status());
  *out = *id;
  return Ok();
}

void kvferry_fence_peer(kvferry_engine* e, uint64_t engine_id) { e->engine->FencePeer(engine_id); }
int kvferry_peer_fenced(const kvferry_engine* e, uint64_t engine_id) {
  return e->engine->PeerFenced(engine_id) ? 1 : 0;
}

int kvferry_metrics_text(kvferry_engine* e, char** text, size_t* length) {
  return kvferry::Give(kvferry::PrometheusText(e->engine->GetMetrics(), e->address), text, length);
}

int kvferry_metrics_json(kvferry_engine* e, char** text, size_t* length) {
  return kvferry::Give(kvferry::MetricsJson(e->engine->GetMetrics()), text, length);
}

int kvferry_local_topology(const char* devices, char** json, size_t* length) {
  kvferry::transport::verbs::DiscoveryOptions d;
  if (devices != nullptr) {
    for (absl::string_view n : absl::StrSplit(devices, ',', absl::SkipWhitespace())) {
      d.devices.emplace_back(absl::StripAsciiWhitespace(n));
    }
  }
  kvferry::transport::verbs::ApplyEnvironment(&d);
  auto found = kvferry::transport::verbs::Discover(d);
  if (!found.ok()) return Fail(found.status());
  return kvferry::Give(kvferry::transport::verbs::TopologyJson(*found), json, length);
}

int kvferry_cuda_available(void) { return kvferry::cuda::Driver::Get() != nullptr ? 1 : 0; }

int kvferry_set_log_level(int level) {
  KVF_REQUIRE(level >= KVFERRY_LOG_DEBUG && level <= KVFERRY_LOG_ERROR,
              absl::StrCat("log level ", level, ": 0 debug, 1 info, 2 warning or 3 error"));
  kvferry::SetLogThreshold(static_cast<kvferry::LogSeverity>(level));
  return Ok();
}

void kvferry_log(int level, const char* message) {
  if (message == nullptr || level < KVFERRY_LOG_DEBUG || level > KVFERRY_LOG_ERROR) return;
  switch (static_cast<kvferry::LogSeverity>(level)) {
    case kvferry::LogSeverity::kDebug:
      KVF_LOG(DEBUG) << message;
      break;
    case kvferry::LogSeverity::kInfo:
      KVF_LOG(INFO) << message;
      break;
    case kvferry::LogSeverity::kWarning:
      KVF_LOG(WARNING) << message;
      break;
    case kvferry::LogSeverity::kError:
      KVF_LOG(ERROR) << message;
      break;
  }
}

int kvferry_kv_pool_allocate(const kvferry_kv_layout* layout, kvferry_kv_pool** out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto l = kvferry::Layout(layout);
  if (!l.ok()) return Fail(l.status());
  auto pool = kvferry::KvPool::Allocate(*l);
  if (!pool.ok()) return Fail(pool.status());
  *out = new kvferry_kv_pool{std::move(*pool)};
  return Ok();
}

int kvferry_kv_pool_wrap(const kvferry_kv_layout* layout, void* const* buffers, size_t count,
                         kvferry_kv_pool** out) {
  KVF_REQUIRE(out != nullptr && (buffers != nullptr || count == 0), "null argument");
  auto l = kvferry::Layout(layout);
  if (!l.ok()) return Fail(l.status());
  auto pool = kvferry::KvPool::Wrap(*l, std::vector<void*>(buffers, buffers + count));
  if (!pool.ok()) return Fail(pool.status());
  *out = new kvferry_kv_pool{std::move(*pool)};
  return Ok();
}

void kvferry_kv_pool_free(kvferry_kv_pool* pool) { delete pool; }

void* kvferry_kv_pool_buffer(const kvferry_kv_pool* pool, uint32_t b) {
  return b < pool->pool.layout().buffer_count() ? pool->pool.buffer(b) : nullptr;
}

int kvferry_kv_sender_create(kvferry_engine* e, const kvferry_kv_pool* pool,
                             const kvferry_kv_sender_options* options, kvferry_kv_sender** out) {
  KVF_REQUIRE(e != nullptr && pool != nullptr && out != nullptr, "null argument");
  kvferry::KvSender::Options o;
  if (options != nullptr) {
    if (options->timeout_ms > 0) o.timeout = absl::Milliseconds(options->timeout_ms);
    o.checksums = options->checksums != 0;
    if (options->tell_timeout_ms > 0) o.tell_timeout = absl::Milliseconds(options->tell_timeout_ms);
  }
  auto s = kvferry::KvSender::Create(e->engine.get(), pool->pool, o);
  if (!s.ok()) return Fail(s.status());
  *out = new kvferry_kv_sender{std::move(*s)};
  return Ok();
}

void kvferry_kv_sender_destroy(kvferry_kv_sender* sender) { delete sender; }

int kvferry_kv_sender_begin(kvferry_kv_sender* s, const char* request_id, const char* peer,
                            const uint32_t* src, const uint32_t* dst, size_t count,
                            uint64_t* handle) {
  KVF_REQUIRE(request_id != nullptr && peer != nullptr && handle != nullptr &&
                  ((src != nullptr && dst != nullptr) || count == 0),
              "null argument");
  auto h = s->sender->Begin(request_id, peer, absl::MakeConstSpan(src, count),
                            absl::MakeConstSpan(dst, count));
  if (!h.ok()) return Fail(h.status());
  *handle = *h;
  return Ok();
}

int kvferry_kv_sender_send_layer(kvferry_kv_sender* s, uint64_t handle, uint32_t layer) {
  return Result(s->sender->SendLayer(handle, layer));
}

int kvferry_kv_sender_send_all(kvferry_kv_sender* s, uint64_t handle) {
  return Result(s->sender->SendAll(handle));
}

int kvferry_kv_sender_finish(kvferry_kv_sender* s, uint64_t handle, const void* aux,
                             size_t aux_length) {
  KVF_REQUIRE(aux != nullptr || aux_length == 0, "null aux");
  return Result(s->sender->Finish(handle, std::string(static_cast<const char*>(aux), aux_length)));
}

int kvferry_kv_sender_cancel(kvferry_kv_sender* s, uint64_t handle, const char* reason) {
  return Result(s->sender->Cancel(handle, reason != nullptr ? reason : ""));
}

int kvferry_kv_sender_send(kvferry_kv_sender* s, const char* request_id, const char* peer,
                           const uint32_t* src, const uint32_t* dst, size_t count, const void* aux,
                           size_t aux_length) {
  KVF_REQUIRE(request_id != nullptr && peer != nullptr &&
                  ((src != nullptr && dst != nullptr) || count == 0) &&
                  (aux != nullptr || aux_length == 0),
              "null argument");
  return Result(s->sender->Send(request_id, peer, absl::MakeConstSpan(src, count),
                                absl::MakeConstSpan(dst, count),
                                std::string(static_cast<const char*>(aux), aux_length)));
}

int kvferry_kv_receiver_create(kvferry_engine* e, const kvferry_kv_pool* pool,
                               int64_t peer_timeout_ms, kvferry_kv_receiver** out) {
  KVF_REQUIRE(e != nullptr && pool != nullptr && out != nullptr, "null argument");
  kvferry::KvReceiver::Options o;
  if (peer_timeout_ms > 0) o.peer_timeout = absl::Milliseconds(peer_timeout_ms);
  auto r = kvferry::KvReceiver::Create(e->engine.get(), pool->pool, o);
  if (!r.ok()) return Fail(r.status());
  *out = new kvferry_kv_receiver{std::move(*r)};
  return Ok();
}

void kvferry_kv_receiver_destroy(kvferry_kv_receiver* receiver) { delete receiver; }

int kvferry_kv_receiver_expect(kvferry_kv_receiver* r, const char* request_id, const char* prefill,
                               uint64_t prefill_engine_id) {
  KVF_REQUIRE(request_id != nullptr && prefill != nullptr, "null argument");
  return Result(r->receiver->Expect(request_id, prefill, prefill_engine_id));
}

namespace {

int KvState(const kvferry::KvReceiver::Status& st, int* state, char** aux, size_t* aux_length) {
  if (aux != nullptr) *aux = nullptr;
  if (aux_length != nullptr) *aux_length = 0;
  switch (st.state) {
    case kvferry::KvReceiver::State::kPending:
      *state = KVFERRY_KV_PENDING;
      return Ok();
    case kvferry::KvReceiver::State::kFailed:
      *state = KVFERRY_KV_FAILED;
      return Fail(st.error.ok() ? absl::UnknownError("failed") : st.error);
    case kvferry::KvReceiver::State::kComplete:
      *state = KVFERRY_KV_COMPLETE;
      return aux != nullptr ? kvferry::Give(st.aux, aux, aux_length) : Ok();
  }
  return Ok();
}

}  // namespace

int kvferry_kv_receiver_poll(kvferry_kv_receiver* r, const char* request_id, int* state, char** aux,
                             size_t* aux_length) {
  KVF_REQUIRE(request_id != nullptr && state != nullptr, "null argument");
  return KvState(r->receiver->Poll(request_id), state, aux, aux_length);
}

int kvferry_kv_receiver_wait(kvferry_kv_receiver* r, const char* request_id, int64_t timeout_ms,
                             int* state, char** aux, size_t* aux_length) {
  KVF_REQUIRE(request_id != nullptr && state != nullptr, "null argument");
  auto st = r->receiver->Wait(request_id, kvferry::Millis(timeout_ms));
  if (!st.ok()) {
    *state = KVFERRY_KV_PENDING;
    if (aux != nullptr) *aux = nullptr;
    if (aux_length != nullptr) *aux_length = 0;
    return Fail(st.status());
  }
  return KvState(*st, state, aux, aux_length);
}

void kvferry_kv_receiver_forget(kvferry_kv_receiver* r, const char* request_id) {
  if (request_id != nullptr) r->receiver->Forget(request_id);
}

uint64_t kvferry_kv_receiver_checksum_failures(const kvferry_kv_receiver* r) {
  return r->receiver->checksum_failures();
}

}  // extern "C"
