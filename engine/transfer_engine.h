// TransferEngine: the public C++ API serving code calls to move bytes
// between engines with zero configuration.
//
//   EngineOptions options;                         // everything automatic
//   auto engine = TransferEngine::Create(options);  // picks host, port, transport
//   engine->RegisterMemory(kv_pool, kv_pool_bytes);
//   auto peer = engine->OpenSegment("10.0.0.7:15000");   // handshake, cached
//   auto batch = engine->Submit(*peer, {{Opcode::kWrite, src, dst_addr, len}});
//   auto status = engine->Wait(*batch, absl::Seconds(5));
//   engine->NotifyAfter(*batch, "request 42 done", absl::Seconds(5));
//
// Peers are named "host:port" (the peer's address()); no configuration file
// and no metadata server. Opening a segment exchanges descriptors (NICs,
// regions, keys) with the peer directly and builds links; the descriptor is
// cached and refreshed when a request falls outside it, when a link fails,
// or when the peer restarted (its engine id changes).
//
// Every request is checked against the peer's advertised regions before
// anything is posted; requests are cut into slices (slice_bytes) that never
// cross a region boundary, spread over the segment's links. A slice that
// fails because a link or the peer went away is retried after a refresh
// (`retries` times); the batch reports each request's own status.
//
// LIFESPAN AND OWNERSHIP. Create returns the only owner. Destroy the engine
// only when no thread is inside any of its methods (a thread in Wait,
// WaitNotification or WaitOnStream included) and after every KvSender and
// KvReceiver made on it. Batches still in flight then are abandoned: the
// transports close their links as the engine goes, so their bytes may or
// may not have landed at the peer, and their ids mean nothing afterwards.
// Memory registered on it must stay mapped until UnregisterMemory or the
// engine's destruction. Ids (SegmentId, BatchId) belong to the engine that
// gave them.
//
// THREADS. Every method may be called from any thread, concurrently.
// Waiting threads drive the transports' completions themselves, one at a
// time; the data path has no polling thread, and a thread whose batch
// another thread completed is woken at once. The engine owns: the
// handshake server's event loop and handler threads (ServeOptions), each
// TCP link's reader and writer threads, the verbs completion poller (RDMA
// only), the metrics endpoint's event loop (metrics_port >= 0), and the
// stream-order thread (started by the first SubmitOnStream). No callback
// runs on a caller's thread but that caller's own call. Blocking: Wait*,
// OpenSegment and Submit (which may handshake, up to handshake_timeout),
// Notify*, FetchMetadata and ProbePeer; the others return without waiting
// on a peer.
#ifndef KVFERRY_ENGINE_TRANSFER_ENGINE_H_
#define KVFERRY_ENGINE_TRANSFER_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/clock.h"
#include "engine/metrics/metrics.h"
#include "engine/prepared/prepared.h"
#include "engine/types.h"
#include "handshake/network.h"
#include "transport/transport.h"

namespace kvferry {

struct EngineOptions {
  // Address to advertise; empty: detected (RDMA netdev, default route,
  // first up interface, loopback — the choice and its reason are logged).
  // "[::1]" is taken for "::1". "0.0.0.0" or "::" with bind_host empty
  // binds every interface and advertises the detected address.
  std::string local_host;
  // Address the handshake and data listeners bind; empty: the advertised
  // address. "0.0.0.0" or "::" binds every interface (only when asked).
  std::string bind_host;
  // Handshake port; 0: the first free port in [first_port, last_port].
  uint16_t port = 0;
  uint16_t first_port = 15000;
  uint16_t last_port = 17000;
  // "auto", "tcp", "rdma" or "sim" (sim needs CreateWith). Where a CUDA
  // driver loads, "auto" and "tcp" also make the same-host transport
  // (EngineParts::same_host); "rdma" keeps verbs alone, peers on this host
  // included.
  std::string transport = "auto";
  // RDMA devices to use (allow-list), e.g. {"mlx5_0", "mlx5_1"}; empty: all.
  std::vector<std::string> devices;
  // GID index for every RDMA port; -1: MC_GID_INDEX or NCCL_IB_GID_INDEX if
  // set, else the ranked choice (docs/rdma-discovery.md).
  int gid_index = -1;
  // Requests are cut into slices of at most this many bytes; 0: the
  // transport's choice (TCP: 1 MiB, where each slice costs a header and
  // an answer; RDMA and the simulator: 64 KiB, which stripes a request
  // over every NIC pair).
  uint64_t slice_bytes = 0;
  // Links (for TCP: connections) opened to each peer, at least one per local
  // NIC; 0: the transport's choice (TCP: 1 on a host where this process may
  // run on fewer than 4 CPUs, where each link's two threads would crowd
  // them, else 2; RDMA and the simulator: 2).
  uint32_t links_per_peer = 0;
  absl::Duration connect_timeout = absl::Seconds(5);
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Re-posts of a slice after a link or peer failure.
  uint32_t retries = 2;
  // Bound on detecting a peer that stopped answering while requests to it
  // are in flight: a link with requests outstanding and no completion for
  // half of this makes a waiting thread probe the peer over the handshake
  // (waiting up to the other half). No answer: those requests fail with
  // kUnavailable and the next Submit handshakes again. An answer from a new
  // engine id (the peer restarted): they are retried on new links.
  absl::Duration peer_timeout = absl::Seconds(4);
  // A segment with nothing in flight and no use for this long has its links
  // closed (connections, queue pairs); its handle stays valid and the next
  // Submit handshakes again. CloseSegment forgets one at once.
  absl::Duration idle_segment_timeout = absl::Minutes(10);
  // Pre-shared handshake secret (at least 16 bytes); empty: the environment
  // variable KVFERRY_SECRET, if set. With a secret, every handshake request
  // and reply is authenticated (HMAC-SHA256, see handshake/auth.h): peers
  // without it get no descriptor, keys, links or notifications, and peers
  // must all use the same secret. Never logged.
  std::string secret;
  // Prometheus endpoint: -1 off; 0 any free port; else that port. Served at
  // http://<metrics_host>:<port>/metrics (metrics_address()); the text
  // format of GetMetrics().
  int metrics_port = -1;
  // Where the metrics endpoint listens: loopback unless said otherwise
  // ("0.0.0.0" for every interface; "" for the handshake's bind address).
  std::string metrics_host = "127.0.0.1";
};

// What Create decided and why; also logged.
struct Detection {
  std::string host;
  std::string host_reason;
  std::string bind_host;
  uint16_t port = 0;
  std::string transport;
  std::string transport_reason;
  std::string devices;
};

// How a stream-ordered batch (TransferEngine::SubmitOnStream) runs.
struct StreamOptions {
  // The stream's later work waits until the batch finished, failed or
  // timed out: a stream synchronization then means its bytes are at the
  // peer (Mooncake's *_on_cuda calls do the same).
  bool hold_stream = true;
  // The batch's bound once the stream reached it.
  absl::Duration timeout = absl::Seconds(30);
  // Keep the outcome for WaitOnStream; false: drop it when done (a failure
  // is logged).
  bool keep_result = true;
  // The CUDA device whose context the stream belongs to; -1: the device of
  // the first request's local memory (device 0 for host memory).
  int device = -1;
};

// Parts an engine is assembled from; Create builds the real ones.
// CreateWith takes ownership of every part; `clock` (not owned) must
// outlive the engine, and `wait` and `near_nics` are called from the
// engine's callers' threads (any of them, concurrently).
struct EngineParts {
  std::unique_ptr<transport::Transport> transport;
  // A second transport for peers the first cannot reach (Create makes a
  // TCP one beside RDMA); null: none. Each peer goes over the best one both
  // ends have: `transport` if the peer's primary is of its kind and links
  // come up, else this one (the choice and why: log and GetMetrics()).
  std::unique_ptr<transport::Transport> fallback;
  // The same-host transport (transport/cuda_ipc; Create makes one where a
  // CUDA driver loads); null: none. Peers on this host that have one too go
  // over it, and device memory is copied GPU to GPU; it is never used for
  // a peer elsewhere (engine/pipeline/path_choice.h).
  std::unique_ptr<transport::Transport> same_host;
  std::unique_ptr<handshake::Network> network;
  Detection detection;
  // The engine's id in descriptors and notifications; 0: a random one.
  uint64_t engine_id = 0;
  // The clock timeouts are measured on; null: the real clock.
  Clock* clock = nullptr;
  // Blocks until ready() holds or the timeout passes; used to wait for
  // notifications. Empty: a condition variable (real time). Simulations
  // pass a function that runs the simulator instead.
  std::function<bool(const std::function<bool()>& ready, absl::Duration timeout)> wait;
  // The local NICs (indices into the transport's NICs) nearest to a buffer
  // at `location` ("cpu:N" or "cuda:N"); an empty list means no preference.
  // Empty function: for "cpu:N" the NICs whose NicInfo.numa_node is N, no
  // preference for anything else. Create() uses the RDMA discovery (PCIe
  // distance to the GPU, NUMA node of the NIC).
  std::function<absl::StatusOr<std::vector<transport::NicIndex>>(const std::string& location)>
      near_nics;
};

class TransferEngine {
 public:
  // Zero-configuration start; see EngineOptions for what is automatic.
  static absl::StatusOr<std::unique_ptr<TransferEngine>> Create(EngineOptions options);
  // Assembles an engine from explicit parts (simulation, tests) and starts
  // serving the handshake on parts.network.
  static absl::StatusOr<std::unique_ptr<TransferEngine>> CreateWith(EngineOptions options,
                                                                    EngineParts parts);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // "host:port" peers pass to OpenSegment.
  std::string address() const;
  const Detection& detection() const;
  uint64_t engine_id() const;
  // The clock the engine's timeouts run on (simulated time in simulation).
  Clock* clock() const;

  // Registers [addr, addr+length) for local use and, per `access`, for
  // peers. kInvalidArgument for bad ranges or an overlap with a region
  // already registered.
  //
  // `access` defaults to kRemoteWrite: peers may write into the buffer (a
  // decode's KV pages) but not read it. A buffer peers should read from
  // (READ requests) must say kRemoteRead or kRemoteReadWrite; kNone keeps
  // it private (a prefill's source pages).
  //
  // `location` says where the buffer lives: "cpu:N" (NUMA node N) or
  // "cuda:N" (GPU N). Slices of requests from this buffer then go over the
  // NICs nearest to it, and over the others only while those are full (every
  // link at the transport's outstanding limit). Empty: every NIC alike.
  // kInvalidArgument for a malformed location, kNotFound for a GPU the
  // RDMA discovery does not know.
  absl::Status RegisterMemory(void* addr, uint64_t length,
                              transport::Access access = transport::Access::kRemoteWrite,
                              const std::string& location = "");
  // Unregisters the region starting at `addr`. kFailedPrecondition while
  // transfers use it; kNotFound if no region starts there.
  absl::Status UnregisterMemory(void* addr);

  // Handshakes with the engine at `peer` ("host:port", "[v6]:port") and
  // returns a handle; the same peer gives the same handle.
  absl::StatusOr<SegmentId> OpenSegment(const std::string& peer);
  // Closes the segment's links and forgets it: the handle becomes unknown,
  // and OpenSegment of the same peer handshakes anew. kFailedPrecondition
  // while batches to it are running; kNotFound for an unknown handle.
  absl::Status CloseSegment(SegmentId segment);

  // The regions the peer advertises (as of the last handshake), sorted by
  // address: where a request may write or read.
  using RemoteRegion = ::kvferry::RemoteRegion;
  absl::StatusOr<std::vector<RemoteRegion>> SegmentRegions(SegmentId segment);
  // The peer instance (its engine id, new on every start) as of the last
  // handshake, which FetchMetadata values also come from.
  absl::StatusOr<uint64_t> PeerEngineId(SegmentId segment);
  // This engine's epoch with the segment's peer, as of its links: 0 until
  // the peer fenced this engine off (declared it failed, while it was only
  // unreachable, say), then higher after each fence this engine learned of
  // (from the peer's refusal). See docs/reliability.md.
  absl::StatusOr<uint64_t> PeerEpoch(SegmentId segment);
  // The peer instance a batch went to (or is going to).
  absl::StatusOr<uint64_t> BatchPeerEngineId(BatchId batch);

  // Posts the requests as one batch. kInvalidArgument (naming the request
  // and the peer) when a request falls outside registered memory on either
  // side, kPermissionDenied when the peer's region forbids the operation;
  // nothing is posted then.
  //
  // A batch's bytes all go to one peer instance. If the peer restarts
  // before any of them landed, an unbound batch (peer_engine_id 0) moves to
  // the new instance (the addresses are checked against its regions); once
  // some landed, or when `peer_engine_id` names the instance the addresses
  // came from (PeerEngineId), the rest fail with kUnavailable instead of
  // being split between a dead peer and its successor.
  //
  // With `peer_epoch` (PeerEpoch, read when the caller bound its series of
  // batches to the peer), the batch fails with kFailedPrecondition once
  // this engine's epoch with the peer is another: the peer fenced this
  // engine meanwhile, took what was in flight as lost, and none of the
  // series may land there afterwards. Without it, a batch already in
  // flight when this engine learns of a fence fails, and later ones go at
  // the new epoch.
  absl::StatusOr<BatchId> Submit(SegmentId segment, absl::Span<const TransferRequest> requests,
                                 uint64_t peer_engine_id = 0,
                                 std::optional<uint64_t> peer_epoch = std::nullopt);
  // The batch's state now, or after waiting up to `timeout` for it to finish.
  absl::StatusOr<BatchStatus> Poll(BatchId batch);
  // Prepared transfers (engine/prepared/prepared.h, docs/nixl.md):
  // descriptor lists checked once, transfers made from index pairs into
  // them and posted again and again, with a notification after the data.
  PreparedTransfers& prepared();
  absl::StatusOr<BatchStatus> Wait(BatchId batch, absl::Duration timeout);
  // Wait that fills `out` instead: its vector keeps its capacity, so a
  // caller reusing one BatchStatus waits without allocating (the engine's
  // submit -> complete -> release path allocates nothing once warm).
  absl::Status Wait(BatchId batch, absl::Duration timeout, BatchStatus* out);
  // Forgets a finished batch. kFailedPrecondition while it is running.
  absl::Status Release(BatchId batch);

  // Stream order (CUDA). Submit reads the local memory of a WRITE when the
  // call is made: memory a kernel or an asynchronous copy is still writing
  // must be finished first, by the caller synchronizing the stream (or an
  // event) that writes it. SubmitOnStream does that in the stream's order
  // instead, without blocking the caller: the batch is queued on `stream`
  // (a CUstream; null: the legacy default stream) behind the work already
  // there, and submitted only once that work finished (the driver calls
  // back, cuLaunchHostFunc). With options.hold_stream the stream's later
  // work waits for the batch (see StreamOptions). Returns at once with an
  // id for WaitOnStream. kFailedPrecondition without a CUDA driver,
  // kResourceExhausted with too many stream-ordered batches outstanding.
  // Errors of the batch itself (a request out of bounds, a peer gone) are
  // WaitOnStream's.
  absl::StatusOr<uint64_t> SubmitOnStream(SegmentId segment,
                                          absl::Span<const TransferRequest> requests, void* stream,
                                          const StreamOptions& options = {});
  // The outcome of a stream-ordered batch once the stream reached it and it
  // finished (and forgets it): its status, or the error that kept it from
  // being submitted. kDeadlineExceeded when that takes longer than
  // `timeout` (ask again); kNotFound for an unknown or collected id.
  absl::StatusOr<BatchStatus> WaitOnStream(uint64_t id, absl::Duration timeout);

  // Sends `message` to the peer now.
  // `peer_engine_id`, if not 0, is the peer instance the message is meant
  // for (see PeerEngineId): a peer that restarted since refuses it
  // (kFailedPrecondition), so a notification never vouches for data that
  // went to its predecessor.
  absl::Status Notify(SegmentId segment, const std::string& message, uint64_t peer_engine_id = 0);
  struct NotifyOptions {
    uint64_t peer_engine_id = 0;  // as above
    // How long to wait for the peer to take it; 0 (and never more than it):
    // handshake_timeout.
    absl::Duration timeout = absl::ZeroDuration();
    // The receiver may ask whether this engine sent it (ConfirmSent): its
    // digest is kept (SHA-256, the last 65,536 so sent). The KV layer's
    // words are; others need not pay for the hash.
    bool confirmable = false;
  };
  absl::Status Notify(SegmentId segment, const std::string& message, const NotifyOptions& options);
  // Waits for `batch` to finish and, only if every request succeeded (so
  // its bytes are in place at the peer), sends `message` to the peer.
  absl::Status NotifyAfter(BatchId batch, const std::string& message, absl::Duration timeout);
  // Publishes `value` under `key` for peers (replacing an earlier value);
  // FetchMetadata reads a peer's. kNotFound when the peer has no such key.
  absl::Status PublishMetadata(const std::string& key, std::string value);
  absl::StatusOr<std::string> FetchMetadata(SegmentId segment, const std::string& key);
  // The same, waiting at most `timeout` (and at most handshake_timeout) for
  // the peer's answer: kDeadlineExceeded or kUnavailable for a peer that is
  // frozen or gone.
  absl::StatusOr<std::string> FetchMetadata(SegmentId segment, const std::string& key,
                                            absl::Duration timeout);

  // The engine id of the engine answering at `peer` ("host:port"), asked
  // over the handshake within `timeout`: kUnavailable or kDeadlineExceeded
  // when it does not answer. A different id than before means the peer
  // restarted. A failure for which PeerAnswered() is true was the peer's
  // own answer (it refused: overloaded, fenced, ...): its process is alive.
  // One for which net::ConnectionRefused() is true found nothing listening
  // at the address: the process is gone.
  absl::StatusOr<uint64_t> ProbePeer(const std::string& peer, absl::Duration timeout);
  static bool PeerAnswered(const absl::Status& status);
  // Whether engine `engine_id`, answering at `peer` ("host:port"), sent
  // the message of `digest` lately, as a confirmable notification
  // (NotifyOptions::confirmable): proof that a notification naming that engine came from
  // it, which its claimed sender id alone is not. False when another engine
  // answers there or it did not send it; an error when it cannot be asked
  // (kUnavailable, kDeadlineExceeded; a peer too old to know the question
  // refuses it).
  absl::StatusOr<bool> ConfirmSent(const std::string& peer, uint64_t engine_id, uint64_t digest,
                                   absl::Duration timeout);
  // The digest ConfirmSent asks about (SHA-256 of the message, 8 bytes).
  static uint64_t NotificationDigest(absl::string_view message);
  // Fences the peer instance `engine_id` once it is declared failed: closes
  // every link it opened to this engine and refuses its links and
  // notifications from then on (kFailedPrecondition to it). When this
  // returns, nothing it sends can land in this engine's memory any more
  // (TCP: the links' reader threads are gone; verbs: its queue pairs are
  // destroyed), even if it was only frozen and resumes. Its successor (a
  // restarted process has a new engine id) is not affected.
  // Logged with `reason` and counted (EngineCounters::peers_fenced).
  void FencePeer(uint64_t engine_id, absl::string_view reason = "");
  bool PeerFenced(uint64_t engine_id) const;
  // Closes every link the peer instance `engine_id` opened to this engine,
  // without fencing it: it reconnects on its next request (its requests in
  // flight on them fail and are retried). When this returns, nothing it
  // sent on those links before lands any more. With a `source` (a
  // Notification's), only the links asked for from that address: what a
  // notification not confirmed by its sender may cost the engine it names.
  void DropLinksFrom(uint64_t engine_id, absl::string_view source = "");
  // Whether `engine_id` holds links to this engine asked for from `source`
  // (any, with an empty one).
  bool HasLinksFrom(uint64_t engine_id, absl::string_view source = "") const;
  // Messages this engine has received so far on the links `engine_id`
  // opened to it (0 where the transports cannot tell): a peer whose count
  // grows is alive even when its handshake does not answer.
  uint64_t DataInputsFrom(uint64_t engine_id) const;

  // Per local NIC: the primary transport's in its order, then the
  // fallback's and the same-host transport's (EngineParts).
  std::vector<NicCounters> GetNicCounters() const;
  EngineCounters GetCounters() const;
  // Counters per peer and per NIC, latency histograms (metrics.h).
  EngineMetrics GetMetrics() const;
  // "host:port" of the Prometheus endpoint, "" when off.
  std::string metrics_address() const;

  // Notifications received so far (and removes them from the inbox).
  std::vector<Notification> TakeNotifications();
  // The oldest notification received (removed from the inbox), waiting up
  // to `timeout` for one; kDeadlineExceeded when none came.
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout);
  // The same for the notifications `which` wants (it is called with the
  // inbox's lock held: it must be quick and call nothing of the engine);
  // the others stay in the inbox, in order, for their own taker (the KV
  // layer takes its words this way, and leaves the rest to the caller).
  using NotificationFilter = std::function<bool(absl::string_view message)>;
  std::vector<Notification> TakeNotifications(const NotificationFilter& which);
  absl::StatusOr<Notification> WaitNotification(absl::Duration timeout,
                                                const NotificationFilter& which);

 private:
  class Impl;
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_TRANSFER_ENGINE_H_
