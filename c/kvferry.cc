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
#include "engine/metrics.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"
#include "transport/verbs/discovery.h"

#ifndef KVFERRY_VERSION
#define KVFERRY_VERSION "0.0.0"
#endif

#include "c/c_util.h"  // Fail, Invalid, Ok, Result, KVF_REQUIRE

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
  auto seg = e->engine->OpenSegment(peer);
  if (!seg.ok()) return Fail(seg.status());
  auto batch = e->engine->Submit(*seg, *reqs);
  if (!batch.ok()) return Fail(batch.status());
  return kvferry_finish(e, *batch, timeout_ms, nullptr);
}

int kvferry_finish(kvferry_engine* e, kvferry_batch batch, int64_t timeout_ms,
                   kvferry_batch_status* out) {
  kvferry::ReleaseAbandoned(*e);
  auto st = e->engine->Wait(batch, kvferry::Millis(timeout_ms));
  if (!st.ok() && st.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return kvferry::EndTimedOut(*e, batch, st.status());
  }
  if (!st.ok()) return Fail(st.status());
  if (!st->done()) return kvferry::EndTimedOut(*e, batch, absl::DeadlineExceededError("timed out"));
  (void)e->engine->Release(batch);
  return kvferry::Outcome(*st, /*pending_is_error=*/true, out);
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

namespace {
absl::StatusOr<std::vector<kvferry::Descriptor>> Descriptors(const uint64_t* addrs,
                                                             const uint64_t* lengths,
                                                             size_t count) {
  if (count > 0 && (addrs == nullptr || lengths == nullptr)) {
    return absl::InvalidArgumentError("null descriptor arrays");
  }
  std::vector<kvferry::Descriptor> d(count);
  for (size_t i = 0; i < count; ++i) d[i] = {addrs[i], lengths[i]};
  return d;
}
int XferState(kvferry::XferState s) {
  switch (s) {
    case kvferry::XferState::kNotPosted:
      return KVFERRY_XFER_NOT_POSTED;
    case kvferry::XferState::kInProgress:
      return KVFERRY_XFER_IN_PROGRESS;
    case kvferry::XferState::kDone:
      break;
  }
  return KVFERRY_XFER_DONE;
}
}  // namespace

int kvferry_prep_local(kvferry_engine* e, const uint64_t* addrs, const uint64_t* lengths,
                       size_t count, uint64_t* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto d = Descriptors(addrs, lengths, count);
  if (!d.ok()) return Fail(d.status());
  auto list = e->engine->prepared().PrepareLocal(*d);
  if (!list.ok()) return Fail(list.status());
  *out = *list;
  return Ok();
}

int kvferry_prep_remote(kvferry_engine* e, kvferry_segment segment, const uint64_t* addrs,
                        const uint64_t* lengths, size_t count, uint64_t* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto d = Descriptors(addrs, lengths, count);
  if (!d.ok()) return Fail(d.status());
  auto list = e->engine->prepared().PrepareRemote(segment, *d);
  if (!list.ok()) return Fail(list.status());
  *out = *list;
  return Ok();
}

int kvferry_release_list(kvferry_engine* e, uint64_t list) {
  return Result(e->engine->prepared().ReleaseList(list));
}

int kvferry_list_size(kvferry_engine* e, uint64_t list, uint64_t* entries, uint64_t* runs) {
  KVF_REQUIRE(entries != nullptr && runs != nullptr, "null output pointer");
  auto size = e->engine->prepared().ListSize(list);
  if (!size.ok()) return Fail(size.status());
  *entries = size->first;
  *runs = size->second;
  return Ok();
}

int kvferry_make_xfer(kvferry_engine* e, int opcode, uint64_t local_list, const int64_t* local_idx,
                      uint64_t remote_list, const int64_t* remote_idx, size_t count,
                      const void* notification, size_t notification_length, int merge,
                      uint64_t* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  KVF_REQUIRE(count == 0 || (local_idx != nullptr && remote_idx != nullptr), "null index arrays");
  KVF_REQUIRE(opcode == KVFERRY_OP_WRITE || opcode == KVFERRY_OP_READ,
              "opcode must be READ or WRITE");
  KVF_REQUIRE(notification != nullptr || notification_length == 0, "null notification");
  kvferry::MakeOptions o;
  o.merge = merge != 0;
  if (notification != nullptr) {
    o.notification.emplace(static_cast<const char*>(notification), notification_length);
  }
  auto x =
      e->engine->prepared().Make(opcode == KVFERRY_OP_READ ? kvferry::transport::Opcode::kRead
                                                           : kvferry::transport::Opcode::kWrite,
                                 local_list, absl::MakeConstSpan(local_idx, count), remote_list,
                                 absl::MakeConstSpan(remote_idx, count), o);
  if (!x.ok()) return Fail(x.status());
  *out = *x;
  return Ok();
}

int kvferry_post_xfer(kvferry_engine* e, uint64_t xfer, const void* notification,
                      size_t notification_length, int32_t* state) {
  KVF_REQUIRE(state != nullptr, "null output pointer");
  KVF_REQUIRE(notification != nullptr || notification_length == 0, "null notification");
  std::optional<std::string> note;
  if (notification != nullptr) {
    note.emplace(static_cast<const char*>(notification), notification_length);
  }
  auto s = e->engine->prepared().Post(xfer, note);
  if (!s.ok()) return Fail(s.status());
  *state = XferState(*s);
  return Ok();
}

int kvferry_xfer_state(kvferry_engine* e, uint64_t xfer, int32_t* state) {
  KVF_REQUIRE(state != nullptr, "null output pointer");
  auto s = e->engine->prepared().State(xfer);
  if (!s.ok()) return Fail(s.status());
  *state = XferState(*s);
  return Ok();
}

int kvferry_xfer_telemetry_get(kvferry_engine* e, uint64_t xfer, kvferry_xfer_telemetry* out) {
  KVF_REQUIRE(out != nullptr, "null output pointer");
  auto t = e->engine->prepared().Telemetry(xfer);
  if (!t.ok()) return Fail(t.status());
  out->start_us = absl::ToUnixMicros(t->start);
  out->post_us = absl::ToInt64Microseconds(t->post);
  out->transfer_us = absl::ToInt64Microseconds(t->transfer);
  out->bytes = t->bytes;
  out->descriptors = t->descriptors;
  return Ok();
}

int kvferry_release_xfer(kvferry_engine* e, uint64_t xfer) {
  return Result(e->engine->prepared().Release(xfer));
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
  // With a KV receiver on the engine, its words stay for it.
  const bool leave_words = e->kv_receivers > 0;
  const kvferry::TransferEngine::NotificationFilter mine = [leave_words](absl::string_view m) {
    return !leave_words || !kvferry::KvReceiver::IsWord(m);
  };
  {
    kvferry::MutexLock lock(&e->mu);
    if (e->notes.empty()) {
      for (kvferry::Notification& t : e->engine->TakeNotifications(mine)) {
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
    auto got = e->engine->WaitNotification(kvferry::Millis(timeout_ms), mine);
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

void kvferry_fence_peer(kvferry_engine* e, uint64_t engine_id) {
  e->engine->FencePeer(engine_id, "the application fenced it (kvferry_fence_peer)");
}
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

}  // extern "C"
