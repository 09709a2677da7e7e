// The Transport over libibverbs Reliable Connected queue pairs: RDMA WRITE
// and READ straight between registered regions, done by the NIC.
//
// One NIC per selected port (from discovery.h): its own device context,
// protection domain, completion channel and CQ. Memory is registered on
// every NIC (one key per NIC). A link is one RC queue pair, set up through
// the handshake: INIT on CreateLink, RTR+RTS on AcceptLink/CompleteLink with
// the peer's QP number, PSN, LID, GID and MTU (path MTU = the smaller
// active MTU). Waiting threads poll the CQs themselves first (busy_poll);
// only while some thread sleeps are completion events requested, and the
// poller thread, woken by them, drains the CQs for it. Work completions map
// to statuses: success OK, remote access error
// kPermissionDenied, flush kAborted, retry/RNR exceeded and everything else
// kUnavailable (with ibv_wc_status_str). The first error puts the QP in the
// error state, exactly as the Transport contract describes.
//
// Every ibv_* call of the project is in this package; failures carry
// context, e.g. "modify QP 0x1a2 to RTR (peer gid ..., mtu 4096): Invalid
// argument".
//
// Thread-safe.
#ifndef KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
#define KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"
#include "transport/verbs/discovery.h"

namespace kvferry {
namespace transport {

struct VerbsTransportOptions {
  // The ports to use, typically Discover(...).selected.
  std::vector<verbs::SelectedPort> ports;
  uint32_t max_outstanding_per_link = 1024;
  uint64_t max_request_bytes = uint64_t{1} << 30;
  // RC transport timeout exponent (4.096 us * 2^timeout) and retry count:
  // a peer that stopped answering fails requests after about
  // (retry_count + 1) * 4.096 us * 2^timeout (14, 7: about 0.5 s).
  uint8_t timeout = 14;
  uint8_t retry_count = 7;
  // A request without a completion after this long fails with kUnavailable
  // and its link is moved to the error state (the rest flush with
  // kAborted). A backstop for NICs that never time out on a vanished peer
  // (Soft-RoCE, seen in the test VM); keep it above the RC retry budget.
  absl::Duration request_timeout = absl::Seconds(10);
  // WaitCompletions polls the CQs itself for up to this long before it
  // sleeps until the poller thread wakes it: a completion that comes soon
  // then costs no thread wake-up (tens of microseconds). Zero: never spin.
  absl::Duration busy_poll = absl::Microseconds(200);
  // WRITEs up to this many bytes are posted inline (IBV_SEND_INLINE: the
  // payload travels in the work request, the NIC reads no local buffer),
  // as far as the device allows; 0: never.
  uint32_t max_inline_bytes = 128;
  // Regions at least this large are registered on every NIC at once (one
  // thread per NIC) instead of one NIC after the other.
  uint64_t parallel_registration_bytes = 64 << 20;
  // Links (queue pairs) this transport holds at most; more are refused with
  // kResourceExhausted (docs/security.md).
  size_t max_links = 1024;
};

// Opens the devices and starts the poller. kUnavailable when a device
// cannot be opened or queried (the message names it), kInvalidArgument for
// no ports.
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(VerbsTransportOptions options);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
