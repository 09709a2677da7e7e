// The C API's internals, shared by its source files (c/kvferry.cc,
// c/kvferry_kv.cc): the handles' definitions and the helpers that turn
// statuses into codes and C++ values into C ones. Nothing here is exported
// from libkvferry.so (kvferry.lds).
#ifndef KVFERRY_C_C_UTIL_H_
#define KVFERRY_C_C_UTIL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "c/kvferry.h"
#include "engine/metrics.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"

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
  // KV receivers on this engine: while there is one, the application's
  // notifications (kvferry_next_notification) leave its words to it.
  std::atomic<int> kv_receivers{0};
};

struct kvferry_kv_pool {
  kvferry::KvPool pool;
};

struct kvferry_kv_sender {
  std::unique_ptr<kvferry::KvSender> sender;
};

struct kvferry_kv_receiver {
  std::unique_ptr<kvferry::KvReceiver> receiver;
  kvferry_engine* engine;
  ~kvferry_kv_receiver() {
    receiver.reset();
    --engine->kv_receivers;
  }
};

namespace kvferry {

// This thread's last error (kvferry_last_error).
extern thread_local std::string last_error;

int Ok();
int Fail(const absl::Status& s);
int Result(const absl::Status& s);
int Invalid(absl::string_view what);
absl::Duration Millis(int64_t ms);
int Give(absl::string_view bytes, char** out, size_t* length);
absl::Status ParseInt(const char* key, const char* value, int64_t lo, int64_t hi, int64_t* out);
absl::Status SetOption(EngineOptions& o, const std::string& key, const char* value);
int64_t FirstFailed(const BatchStatus& st);
int Outcome(const BatchStatus& st, bool pending_is_error, kvferry_batch_status* out);
void ReleaseAbandoned(kvferry_engine& e);
// A synchronous transfer that did not finish within its timeout: the engine
// cannot call back bytes already on their way, so the call ends only when
// nothing of it can land any more. It waits for the batch to end (the
// engine's failure bounds end it: peer_timeout, the handshake timeout) for
// at most kDrainBound, releases it, and fails with kDeadlineExceeded
// saying so. Past kDrainBound (an engine fault) the batch is kept for a
// later call to release and the message says its bytes may still land.
constexpr absl::Duration kDrainBound = absl::Seconds(60);
int EndTimedOut(kvferry_engine& e, BatchId batch, const absl::Status& at_timeout);
absl::StatusOr<std::vector<TransferRequest>> Columns(int opcode, const uint64_t* local,
                                                     const uint64_t* remote,
                                                     const uint64_t* lengths, size_t count);
absl::StatusOr<KvLayout> Layout(const kvferry_kv_layout* l);
void JsonString(std::string* out, absl::string_view s);
void JsonCounts(std::string* out, const std::map<std::string, uint64_t>& m);
std::string MetricsJson(const EngineMetrics& m);

}  // namespace kvferry

using kvferry::Fail;
using kvferry::Invalid;
using kvferry::Ok;
using kvferry::Result;

#define KVF_REQUIRE(cond, what)        \
  do {                                 \
    if (!(cond)) return Invalid(what); \
  } while (0)

#endif  // KVFERRY_C_C_UTIL_H_
