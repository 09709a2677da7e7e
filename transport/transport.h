// The Transport interface: one-sided RDMA-style data movement between
// registered memory regions of two processes. Everything above it (the
// handshake, the engine, the KV layer) is written against this header only;
// implementations live in transport/verbs (libibverbs RC), transport/tcp
// (sockets) and transport/sim (the deterministic simulated fabric).
//
// The model is libibverbs' Reliable Connected service:
//
//  * NICs. A transport owns one or more local NICs, numbered 0..n-1 in the
//    order LocalEndpoint() lists them. A NIC's `address` is opaque bytes the
//    handshake carries to peers (GID/LID for verbs, ip:port for TCP, a fabric
//    id for sim).
//
//  * Regions. RegisterMemory pins/registers [addr, addr+length) and returns
//    one remote key per local NIC (keys[i] is valid for requests arriving on
//    NIC i). The caller owns the memory and must keep it alive until
//    UnregisterMemory returns OK (which waits for peer writes in progress;
//    requests a peer cancelled may still be landing until then). A region's
//    Access decides what peers may do; local use (as the source of a WRITE
//    or the sink of a READ) is always allowed. Regions may overlap.
//
//  * Links. A link joins one local NIC to one NIC of a peer (an RC queue
//    pair). It is set up in three steps whose `params` bytes travel over the
//    handshake:
//        active:  CreateLink(local_nic, peer_nic)      -> {link, params_a}
//        passive: AcceptLink(local_nic, peer_nic, params_a) -> {link, params_p}
//        active:  CompleteLink(link, params_p)
//    After AcceptLink (passive) or CompleteLink (active) the link is
//    established and either side may post on it. Links are never shared
//    between transports.
//
//  * Requests. Post() queues a batch of WRITEs (local -> remote) and READs
//    (remote -> local). The local buffer must lie inside a region registered
//    on this transport; the remote range must lie inside a region of the peer
//    whose key for the link's remote NIC is `remote_key`. The local buffer
//    must not be touched by the caller until the request completes.
//
//  * Completions. Every request accepted by Post() completes exactly once,
//    delivered by PollCompletions() or WaitCompletions() with the request's
//    `cookie`. No order is promised between completions, not even on one
//    link: an OK completion of one request says nothing about another.
//    A request stays outstanding (and pins its local region, see
//    UnregisterMemory) until its completion has been delivered.
//
//  * Link failure. As with an RC queue pair, the first error completion on
//    a link puts it into the error state: every other request outstanding on
//    it completes with kAborted, and Post() on it returns
//    kFailedPrecondition. Close it and build a new link (the engine does this
//    through the handshake).
//
// Status codes, in completions:
//   OK                  every byte is in place (WRITE: in the peer's region,
//                       READ: in the local buffer).
//   kPermissionDenied   the peer refused the access: unknown or stale key,
//                       range outside the region, or the region's Access
//                       forbids it. No byte of the peer's memory changed.
//   kUnavailable        the peer or the path did not answer within the
//                       transport's retry budget (peer crashed, NIC down,
//                       partition), or an error completion with unknown data
//                       state. Bytes of a WRITE may or may not have landed.
//   kAborted            flushed because the link failed earlier. Its data
//                       may or may not have been placed; retry it on a new
//                       link (a WRITE retried writes the same bytes again).
//   kCancelled          the link was closed locally while the request was
//                       outstanding.
// Status codes, from calls:
//   kInvalidArgument    malformed input: unknown link/region/NIC, local
//                       range outside its region, bad params bytes.
//   kFailedPrecondition wrong state: link not established or in error,
//                       region still in use by outstanding requests.
//   kResourceExhausted  a queue or table limit (see Limits) would be passed.
//   kNotFound           UnregisterMemory/CloseLink of an unknown id.
//   kUnavailable        a NIC is down or the peer cannot be reached now.
// A call that returns an error changed nothing: Post() is all-or-nothing.
//
// Zero-length requests complete OK without touching memory; as in the
// InfiniBand specification, their remote key is not checked.
//
// Thread safety: implementations for real hardware are thread-safe (any
// method from any thread). The simulated transport is driven by the single
// thread that runs the simulator and says so in its header. Destroying a
// transport closes all its links; completions not yet delivered are
// discarded and peers see their requests fail with kUnavailable.
#ifndef KVFERRY_TRANSPORT_TRANSPORT_H_
#define KVFERRY_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvferry {
namespace transport {

// Index of a local NIC, 0..LocalEndpoint().nics.size()-1.
using NicIndex = uint32_t;
// Local handle of a registered region; never reused by one transport.
using RegionId = uint64_t;
// Local handle of a link; never reused by one transport.
using LinkId = uint64_t;
// The key a peer presents to access a region through one NIC.
using RemoteKey = uint64_t;

// What peers may do with a region. Local access is always allowed.
enum class Access : uint8_t {
  kNone = 0,
  kRemoteRead = 1,
  kRemoteWrite = 2,
  kRemoteReadWrite = 3,
};
inline bool AllowsRemoteRead(Access a) { return (static_cast<uint8_t>(a) & 1) != 0; }
inline bool AllowsRemoteWrite(Access a) { return (static_cast<uint8_t>(a) & 2) != 0; }

// One local NIC as peers see it.
struct NicInfo {
  std::string name;                // e.g. "mlx5_0", "lo", "sim-n1-nic0"
  std::string address;             // opaque transport-specific addressing bytes
  int32_t numa_node = -1;          // -1 when unknown
  uint64_t link_bits_per_sec = 0;  // 0 when unknown
  uint32_t mtu = 0;                // active MTU in bytes, 0 when unknown
};

// What LocalEndpoint() describes: everything a peer needs to build links.
struct EndpointDescription {
  std::string kind;  // "verbs", "tcp" or "sim"; peers must match
  std::vector<NicInfo> nics;
};

// A registered region.
struct Region {
  RegionId id = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  Access access = Access::kNone;
  std::vector<RemoteKey> keys;  // keys[i]: key for requests arriving on NIC i
};

// The local half of a link being set up and the bytes to send to the peer.
struct LinkOffer {
  LinkId link = 0;
  std::string params;
};

enum class Opcode : uint8_t { kWrite, kRead };

// One one-sided request.
struct WorkRequest {
  Opcode opcode = Opcode::kWrite;
  LinkId link = 0;
  RegionId local_region = 0;  // region containing [local_addr, +length)
  void* local_addr = nullptr;
  uint64_t length = 0;
  uint64_t remote_addr = 0;  // address in the peer's address space
  RemoteKey remote_key = 0;
  uint64_t cookie = 0;  // returned unchanged in the completion
};

struct Completion {
  uint64_t cookie = 0;
  absl::Status status;
};

// Limits an implementation enforces (kResourceExhausted beyond them).
struct Limits {
  uint32_t max_outstanding_per_link = 0;
  uint64_t max_request_bytes = 0;
  uint64_t max_region_bytes = 0;
  // The request size this transport moves best, for an engine that lets
  // the transport choose its slice size; 0: no preference.
  uint64_t preferred_request_bytes = 0;
  // The links per peer it moves data best over, for an engine that lets the
  // transport choose; 0: no preference.
  uint32_t preferred_links = 0;
  // Whether AcceptLink may wait (for the peer's connection, or on the NIC).
  // False: it returns promptly, and the handshake answers link requests on
  // its event loop instead of handing them to a handler thread (two thread
  // hand-offs fewer per new peer).
  bool accept_waits = true;
};

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // The local NICs and addressing, for the handshake to carry to peers.
  virtual EndpointDescription LocalEndpoint() const = 0;
  virtual Limits GetLimits() const = 0;

  // Registers [addr, addr+length) on every local NIC. kInvalidArgument for a
  // null address or zero length; kResourceExhausted above the limits.
  virtual absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) = 0;
  // Revokes the region's keys: later remote requests fail with
  // kPermissionDenied. kFailedPrecondition while local requests using it are
  // outstanding; kNotFound for an unknown id.
  virtual absl::Status UnregisterMemory(RegionId region) = 0;

  // Link setup, see the file comment. `peer_nic` comes from the peer's
  // EndpointDescription.
  virtual absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) = 0;
  virtual absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                               absl::string_view peer_params) = 0;
  virtual absl::Status CompleteLink(LinkId link, absl::string_view peer_params) = 0;
  // The local NIC that reaches `peer_nic` by this host's routes, when the
  // transport can tell (verbs, through rdma_cm); otherwise an error saying
  // why, and the caller pairs NICs by its own rule.
  virtual absl::StatusOr<NicIndex> RouteTo(const NicInfo& peer_nic) {
    (void)peer_nic;
    return absl::UnimplementedError("this transport has no route information");
  }
  // Tears the link down; its outstanding requests complete with kCancelled.
  // Once it returns, nothing the peer sends on the link lands in memory.
  virtual absl::Status CloseLink(LinkId link) = 0;
  // Whether `link` is still open (a passive link whose peer went away may
  // be gone already).
  virtual bool HasLink(LinkId link) = 0;
  // How many messages `link` has received from its peer so far (requests
  // and answers): a peer whose count grows is alive, whatever its other
  // channels say. 0 where the transport cannot tell (one-sided RDMA, which
  // the CPU never sees).
  virtual uint64_t InputCount(LinkId link) {
    (void)link;
    return 0;
  }

  // Queues the batch, all or nothing (see the file comment for codes).
  virtual absl::Status Post(absl::Span<const WorkRequest> batch) = 0;

  // Moves up to out.size() completions into `out` without blocking; returns
  // how many.
  virtual size_t PollCompletions(absl::Span<Completion> out) = 0;
  // Like PollCompletions, but first waits up to `timeout` for at least one
  // (wall time on real transports, simulated time on sim).
  virtual size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) = 0;
  // Makes a thread waiting in WaitCompletions return now, with what it has
  // (possibly nothing); when none waits, the next WaitCompletions call
  // returns at once. For callers that poll from several threads: one that
  // took completions another thread may be waiting for wakes it with this.
  // A transport whose WaitCompletions never waits in real time (the
  // simulated one) needs nothing here.
  virtual void InterruptWait() {}
  // For a caller that waits on several transports at once: `notify` is
  // called after completions are queued (from the transport's threads,
  // possibly with its locks held: it must only signal, never call back
  // into the transport). Real transports support it and return true; the
  // simulated one runs in simulated time and returns false.
  virtual bool SetCompletionNotifier(std::function<void()> notify) {
    (void)notify;
    return false;
  }
  // Input from the network this transport refused or cut off so far, by
  // reason (for metrics; docs/security.md). Empty where nothing is counted.
  virtual std::vector<std::pair<std::string, uint64_t>> RefusedInput() const { return {}; }
  // An extension interface this transport also implements, by the name the
  // extension's header gives it (e.g. StreamLinks::kName in
  // transport/stream_links.h); null when it has none of that name. What
  // only some transports can do lives in extensions, so that this interface
  // stays the one every transport implements. The pointer lives as long as
  // the transport. Use ExtensionOf<E>() below.
  virtual void* QueryExtension(absl::string_view name) {
    (void)name;
    return nullptr;
  }

 protected:
  Transport() = default;
};

// `transport`'s extension E (a class with a `kName`), or null.
template <typename E>
E* ExtensionOf(Transport* transport) {
  return static_cast<E*>(transport->QueryExtension(E::kName));
}

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TRANSPORT_H_
