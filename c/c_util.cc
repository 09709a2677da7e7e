// The C API's helpers: status codes and this thread's last error, copies
// handed to the caller, batch outcomes, options, metrics as JSON.
#include "c/c_util.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"

namespace kvferry {

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

int EndTimedOut(kvferry_engine& e, BatchId batch, const absl::Status& at_timeout) {
  const absl::Time start = absl::Now();
  absl::StatusOr<BatchStatus> end = e.engine->Wait(batch, kDrainBound);
  const absl::Duration more = absl::Now() - start;
  const std::string head(at_timeout.message());
  if (end.ok() && end->done()) {
    (void)e.engine->Release(batch);
    return Fail(absl::DeadlineExceededError(absl::StrCat(
        head, "; waited ", absl::FormatDuration(absl::Trunc(more, absl::Milliseconds(1))),
        " more until the transfer ended (", end->failed == 0 ? "it completed" : "it failed",
        "): nothing of it lands after this")));
  }
  MutexLock lock(&e.mu);
  e.abandoned.push_back(batch);
  return Fail(absl::DeadlineExceededError(absl::StrCat(head, "; still running ",
                                                       absl::FormatDuration(kDrainBound),
                                                       " later: its bytes may still land")));
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

namespace {
// Appends `items` as a JSON array, each written by `one`.
template <typename T, typename Fn>
void JsonArray(std::string* out, const std::vector<T>& items, Fn one) {
  out->push_back('[');
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out->append(", ");
    one(items[i]);
  }
  out->push_back(']');
}
}  // namespace

std::string MetricsJson(const EngineMetrics& m) {
  std::string out = "{\"peers\": ";
  JsonArray(&out, m.peers, [&out](const PeerMetrics& p) {
    out.append("{\"peer\": ");
    JsonString(&out, p.peer);
    absl::StrAppend(&out, ", \"requests\": ", p.requests, ", \"requests_ok\": ", p.requests_ok,
                    ", \"bytes_written\": ", p.bytes_written, ", \"bytes_read\": ", p.bytes_read,
                    ", \"slices\": ", p.slices, ", \"retries\": ", p.retries,
                    ", \"reconnects\": ", p.reconnects, ", \"errors\": ");
    JsonCounts(&out, p.errors);
    absl::StrAppend(&out, ", \"latency_p50_s\": ", p.latency.QuantileBound(0.5),
                    ", \"latency_p99_s\": ", p.latency.QuantileBound(0.99), "}");
  });
  out.append(", \"nics\": ");
  JsonArray(&out, m.nics, [&out](const NicMetrics& n) {
    out.append("{\"name\": ");
    JsonString(&out, n.name);
    absl::StrAppend(&out, ", \"slices\": ", n.slices, ", \"bytes\": ", n.bytes,
                    ", \"errors\": ", n.errors, ", \"errors_by_code\": ");
    JsonCounts(&out, n.errors_by_code);
    absl::StrAppend(&out, ", \"retries\": ", n.retries, "}");
  });
  out.append("}");
  return out;
}

}  // namespace kvferry
