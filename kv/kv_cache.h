// The KV-cache layer: moves the KV pages of LLM requests from a prefill
// engine to a decode engine, in the terms serving code uses (layers, pages,
// requests), on top of TransferEngine.
//
//   // decode side
//   KvLayout layout{...};
//   auto pool = KvPool::Allocate(layout);            // or KvPool::Wrap(buffers)
//   auto receiver = KvReceiver::Create(engine, pool);  // registers + publishes it
//   ... receiver->Wait("req-42", absl::Seconds(5)) -> complete, aux payload
//
//   // prefill side
//   auto sender = KvSender::Create(engine, pool);
//   auto req = sender->Begin("req-42", "decode-host:15000", src_pages, dst_pages);
//   for (layer...) { compute(layer); sender->SendLayer(*req, layer); }
//   sender->Finish(*req, aux, absl::Seconds(5));   // data first, then notification
//
// Pairs of (src, dst) page indices are coalesced into maximal runs that are
// contiguous on both sides; each run becomes one transfer per buffer. The
// decode side learns about a request only from its completion (or
// cancellation) notification, which is sent after every byte is in place; a
// failed or cancelled request never shows as complete.
#ifndef KVFERRY_KV_KV_CACHE_H_
#define KVFERRY_KV_KV_CACHE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "engine/transfer_engine.h"
#include "kv/kv_receiver_internal.h"
#include "kv/kv_request.h"

namespace kvferry {
namespace kv_internal {
struct Word;
class EarlyWords;
}  // namespace kv_internal

// How a KV pool is laid out in memory.
struct KvLayout {
  uint32_t layers = 0;
  // One combined buffer per layer (MLA), or separate K and V buffers (MHA/GQA).
  bool combined_kv = false;
  uint32_t page_tokens = 0;
  // Bytes per token in one buffer (e.g. kv_heads * head_dim * 2 for bf16).
  uint64_t bytes_per_token = 0;
  // Pages in each buffer.
  uint32_t pages = 0;

  uint32_t buffers_per_layer() const { return combined_kv ? 1 : 2; }
  uint32_t buffer_count() const { return layers * buffers_per_layer(); }
  uint64_t page_bytes() const { return uint64_t{page_tokens} * bytes_per_token; }
  uint64_t buffer_bytes() const { return page_bytes() * pages; }
  // kInvalidArgument for zero or absurd sizes.
  absl::Status Validate() const;
  // A compact text form, published by the receiver and checked by senders.
  std::string Encode() const;
  static absl::StatusOr<KvLayout> Decode(absl::string_view text);
};

// Where a pool's buffers are: buffer b = layer * buffers_per_layer + (0 K | 1 V).
class KvPool {
 public:
  // Allocates one contiguous, zeroed pool owned by the returned object.
  static absl::StatusOr<KvPool> Allocate(const KvLayout& layout);
  // Describes buffers the caller owns (one per layer and K/V), e.g. a
  // serving framework's per-layer tensors. They may be CUDA device memory
  // (asked of the driver, where one loads): the pool then reads them for
  // checksums only through the driver, never with the CPU.
  static absl::StatusOr<KvPool> Wrap(const KvLayout& layout, std::vector<void*> buffers);

  const KvLayout& layout() const { return layout_; }
  char* buffer(uint32_t b) const { return static_cast<char*>(buffers_[b]); }
  char* page(uint32_t layer, uint32_t kv, uint32_t page) const {
    return buffer(layer * layout_.buffers_per_layer() + kv) + uint64_t{page} * layout_.page_bytes();
  }
  bool contiguous() const { return storage_ != nullptr; }
  // The CUDA device buffer `b` lives on; -1 for host memory.
  int device(uint32_t b) const { return devices_.empty() ? -1 : devices_[b]; }
  // Registers every buffer with `engine` (one region for a contiguous pool).
  absl::Status Register(TransferEngine& engine, transport::Access access) const;

 private:
  KvLayout layout_;
  std::vector<void*> buffers_;
  std::vector<int> devices_;       // per buffer (empty: all host memory)
  std::shared_ptr<char> storage_;  // set when Allocate owns the memory
};

// A run of `count` pages: src, src+1, ... go to dst, dst+1, ...
struct PageRun {
  uint32_t src = 0;
  uint32_t dst = 0;
  uint32_t count = 0;
  bool operator==(const PageRun& o) const {
    return src == o.src && dst == o.dst && count == o.count;
  }
};

// Coalesces (src[i], dst[i]) pairs into the fewest runs contiguous on both
// sides (order of pairs does not matter). kInvalidArgument when the lists
// differ in length or a destination page repeats.
absl::StatusOr<std::vector<PageRun>> CoalescePages(absl::Span<const uint32_t> src,
                                                   absl::Span<const uint32_t> dst);

class KvSender {
 public:
  struct Options {
    absl::Duration timeout = absl::Seconds(30);
    // End-to-end integrity: Finish sends a CRC-32C per page (over that page
    // in every buffer, K and V of every layer) with the completion, and the
    // receiver checks its copy before reporting the request complete; a
    // mismatch fails it with kDataLoss. At most kMaxChecksumPages pages.
    // Pages in GPU memory are read through pinned host buffers by the
    // driver (docs/kv.md gives the cost).
    bool checksums = false;
    // How long a completion or failure that cannot reach the decode is
    // retried (at least the decode's KvReceiver peer_timeout).
    absl::Duration tell_timeout = absl::Seconds(4);
    // How long Begin waits for the decode to describe its pool: a frozen
    // or vanished decode fails the request within it (as the decode's
    // receiver fails a silent prefill within its own peer_timeout), not
    // after the engine's handshake_timeout. The first contact with a decode
    // (its handshake) still takes up to handshake_timeout.
    absl::Duration peer_timeout = absl::Seconds(4);
    // Begin tells the decode the request began and where this engine
    // answers (one notification round trip), so that a decode that waits
    // without Expect still learns of this engine's death. Off saves that
    // round trip where every decode calls Expect.
    bool announce = true;
  };
  static constexpr uint32_t kMaxChecksumPages = 32768;
  // `pool` is registered with `engine` (local access only) and stays
  // registered. `engine` must outlive the sender. Destroy it only when no thread is inside one of
  // its methods. Its methods may be called from any thread; requests are
  // independent, but one handle is used by one thread at a time. Begin and
  // SendLayer return once the bytes are posted; Finish, Cancel and Send
  // block until the decode has been told (up to timeout + tell_timeout).
  // It owns no thread.
  static absl::StatusOr<std::unique_ptr<KvSender>> Create(TransferEngine* engine, KvPool pool,
                                                          Options options);
  static absl::StatusOr<std::unique_ptr<KvSender>> Create(TransferEngine* engine, KvPool pool) {
    return Create(engine, std::move(pool), Options());
  }

  using Handle = uint64_t;
  // Starts request `request_id` to the decode engine at `peer`: checks the
  // peer's published layout against ours, the page indices against both
  // pools, and coalesces them. Nothing is sent yet. If it fails, the decode
  // is told the request will not come (its KvReceiver reports it failed,
  // "not started: ...").
  absl::StatusOr<Handle> Begin(const std::string& request_id, const std::string& peer,
                               absl::Span<const uint32_t> src_pages,
                               absl::Span<const uint32_t> dst_pages) ABSL_LOCKS_EXCLUDED(mu_);
  // Layer-wise mode: sends layer `layer` now (e.g. as soon as it is computed).
  absl::Status SendLayer(Handle h, uint32_t layer) ABSL_LOCKS_EXCLUDED(mu_);
  // Whole-request mode: sends every layer not sent yet.
  absl::Status SendAll(Handle h) ABSL_LOCKS_EXCLUDED(mu_);
  // Sends what remains, waits for every byte, then delivers the completion
  // notification with `aux` (at most 512 KiB). On failure the decode side
  // is told the request failed. The handle is gone afterwards.
  absl::Status Finish(Handle h, const std::string& aux) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops sending, waits for what is in flight, tells the decode side the
  // request failed ("cancelled: <reason>"). The handle is gone afterwards.
  absl::Status Cancel(Handle h, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

  // Begin + SendAll + Finish.
  absl::Status Send(const std::string& request_id, const std::string& peer,
                    absl::Span<const uint32_t> src_pages, absl::Span<const uint32_t> dst_pages,
                    const std::string& aux) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Request {
    std::string id;
    SegmentId segment = 0;
    // The decode instance whose pool `remote_buffers` describes; batches and
    // the final notification go to it or fail.
    uint64_t peer_engine_id = 0;
    // This engine's epoch with the decode then (TransferEngine::PeerEpoch):
    // once the decode fenced this engine, none of the request's layers go.
    uint64_t peer_epoch = 0;
    bool announce = false;  // the decode reads "begn" words (kv_words.h)
    std::vector<void*> remote_buffers;
    std::vector<PageRun> runs;
    std::vector<bool> sent;  // per layer
    std::vector<BatchId> batches;
    absl::Status error;
    uint64_t token = 0;  // this attempt, in every word about it
  };
  KvSender(TransferEngine* engine, KvPool pool, Options options)
      : engine_(engine), pool_(std::move(pool)), options_(options) {}
  absl::StatusOr<Request*> Find(Handle h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes request `h` from the table and hands it over (kNotFound).
  absl::StatusOr<std::unique_ptr<Request>> Take(Handle h);
  // Waits for the request's batches; the first failure, if any.
  // *uncertain: writes were posted (a late copy of one may still land).
  absl::Status Drain(Request& r, bool* uncertain);
  absl::StatusOr<std::unique_ptr<Request>> Prepare(const std::string& request_id,
                                                   const std::string& peer,
                                                   absl::Span<const uint32_t> src_pages,
                                                   absl::Span<const uint32_t> dst_pages);
  absl::Status Tell(const Request& r, const std::string& message);
  // Tells the decode the request began, and where this engine answers
  // (a "begn" word), once.
  void Announce(const Request& r);
  // Delivers `message` over segment(), retrying passing failures.
  absl::Status Say(const std::function<absl::StatusOr<SegmentId>()>& segment, uint64_t instance,
                   const std::string& message);

  TransferEngine* const engine_;
  const KvPool pool_;
  const Options options_;
  Mutex mu_;
  Handle last_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Handle, std::unique_ptr<Request>> requests_ ABSL_GUARDED_BY(mu_);
};

class KvReceiver {
 public:
  using State = KvRequestState;    // kv/kv_request.h
  using Status = KvRequestStatus;  // its state, error or aux payload
  struct Options {
    // A prefill that an expected request comes from (Expect) and that stays
    // dead, frozen or unreachable this long fails its requests; the report
    // comes within this bound of its death. It is probed every quarter of
    // it.
    absl::Duration peer_timeout = absl::Seconds(4);
    // A word about a request nobody expects or waits for yet (its prefill
    // was quicker than the decode's Expect, or it is forged) is kept this
    // long, at most kMaxEarlyWords of them and kMaxEarlyBytes of their aux
    // payloads (the oldest go first), for an Expect, Poll or Wait to come.
    absl::Duration early_word_ttl = absl::Seconds(60);
  };
  static constexpr size_t kMaxEarlyWords = kv_internal::kMaxEarlyWords;
  static constexpr size_t kMaxEarlyBytes = kv_internal::kMaxEarlyBytes;

  // Registers `pool` for remote writes and publishes its layout so senders
  // can find it. `engine` must outlive the receiver. It takes only the KV
  // layer's words from the engine's notifications; the rest stay in the
  // engine's inbox for the application (TransferEngine::TakeNotifications,
  // or TakeOtherNotifications here). Destroy it only
  // when no thread is inside one of its methods; the destructor stops and
  // joins its thread. Its methods may be called from any thread. It owns
  // one thread, started by the first Expect, that probes the prefills
  // expected requests come from.
  static absl::StatusOr<std::unique_ptr<KvReceiver>> Create(TransferEngine* engine, KvPool pool,
                                                            Options options);
  static absl::StatusOr<std::unique_ptr<KvReceiver>> Create(TransferEngine* engine, KvPool pool) {
    return Create(engine, std::move(pool), Options());
  }
  // Whether a notification is one of the KV layer's words (what a receiver
  // takes from its engine's inbox).
  static bool IsWord(absl::string_view message);
  ~KvReceiver();

  // Declares that request `request_id` is to come from the prefill engine at
  // `prefill` ("host:port"), e.g. when the decode has allocated its pages
  // and told the prefill where to write. If that prefill dies, freezes,
  // restarts or cannot be reached for peer_timeout before the request
  // completes (even one it never started), the request fails with
  // kUnavailable naming the cause, and before that is reported the prefill
  // is fenced (TransferEngine::FencePeer): no byte of it lands in the pool
  // afterwards. A word about the request from another engine (a dead
  // prefill's successor, or an earlier instance) is ignored. A request that
  // already finished (its word came before this call) is left as it is.
  // kInvalidArgument for a bad address.
  //
  // `prefill_engine_id` names the prefill instance (its engine_id(), e.g.
  // passed along with its address); 0: Expect asks the prefill (one round
  // trip, when no request from it is pending). A prefill that cannot be
  // asked then and restarts later is not told from its successor.
  absl::Status Expect(const std::string& request_id, const std::string& prefill,
                      uint64_t prefill_engine_id = 0) ABSL_LOCKS_EXCLUDED(state_.mu);

  const KvPool& pool() const { return pool_; }
  // The request's state now (kPending if nothing has been heard of it).
  Status Poll(const std::string& request_id) ABSL_LOCKS_EXCLUDED(state_.mu);
  // Waits until the request completes or fails (several threads may wait,
  // each for its own request). kDeadlineExceeded if it is still pending
  // after `timeout`.
  absl::StatusOr<Status> Wait(const std::string& request_id, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(state_.mu);
  // Forgets a finished request (its aux payload too).
  void Forget(const std::string& request_id) ABSL_LOCKS_EXCLUDED(state_.mu);
  // The engine's notifications that are not KV-layer words (taken from its
  // inbox).
  std::vector<Notification> TakeOtherNotifications();
  // Requests whose pages did not match the sender's checksums.
  uint64_t checksum_failures() const ABSL_LOCKS_EXCLUDED(state_.mu);
  // Words about expected requests that came from another engine (ignored).
  uint64_t ignored_words() const ABSL_LOCKS_EXCLUDED(state_.mu);
  // Words about requests nobody expected that were dropped unclaimed (too
  // old, or pushed out by newer ones).
  uint64_t dropped_early_words() const ABSL_LOCKS_EXCLUDED(state_.mu);
  // Words about expected requests that the engine they name did not
  // confirm sending (forged, or from a prefill that could not be asked):
  // ignored.
  uint64_t unconfirmed_words() const ABSL_LOCKS_EXCLUDED(state_.mu);

 private:
  KvReceiver(TransferEngine* engine, KvPool pool, Options options);

  const KvPool pool_;
  // Its units (kv/kv_receiver_internal.h); the watcher is declared after
  // the state, so its thread is joined before the state goes.
  kv_internal::ReceiverState state_;
  kv_internal::PrefillWatcher watcher_{state_};
  kv_internal::WordTaker words_{state_, watcher_};
};

// The metadata key under which a receiver publishes its pool.
inline constexpr char kKvPoolMetadataKey[] = "kvferry.kv_pool";

}  // namespace kvferry

#endif  // KVFERRY_KV_KV_CACHE_H_
