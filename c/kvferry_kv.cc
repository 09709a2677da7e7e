// The C API of the KV layer (kvferry_kv_*): pools, senders, receivers.
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "c/c_util.h"

extern "C" {

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
  ++e->kv_receivers;
  *out = new kvferry_kv_receiver{std::move(*r), e};
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
