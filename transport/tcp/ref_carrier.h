// What the TCP stream does for a HostShare (transport/host_share.h,
// TcpTransportOptions::host_share): the same-host facts its link
// parameters carry, a link's share state, naming a request's local bytes
// as a reference, and serving a peer's reference. The stream only carries
// references; what one means is the share's business.
//
// Thread-safe (const); a link's LinkShare is the link's: its `ok` under the
// transport's lock, its `imports` the reader thread's alone.
// Internal to transport/tcp.
#ifndef KVFERRY_TRANSPORT_TCP_REF_CARRIER_H_
#define KVFERRY_TRANSPORT_TCP_REF_CARRIER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "transport/host_share.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

// This host's identity (its kernel's boot id, which the containers on a
// host share): links between two transports on one host may share memory.
uint64_t HostId();

// One link's sharing.
struct LinkShare {
  // Both ends on this host, each with a host share: requests may carry
  // references (while `ok`: until the peer says it cannot open one).
  bool same_host = false;
  bool ok = true;
  uint64_t peer_word = 0;  // the peer's HostShare::LinkWord
  // The references this end opened for the peer's requests (reader thread
  // only; same host only), closed when destroyed.
  std::unique_ptr<HostShare::Imports> imports;
};

class RefCarrier {
 public:
  // `share` null: no references either way. `same_host_only`: links to
  // other hosts are refused (needs a share).
  RefCarrier(std::shared_ptr<HostShare> share, bool same_host_only, std::string kind)
      : share_(std::move(share)), same_host_only_(same_host_only), kind_(std::move(kind)) {}

  // What this end's link parameters say: the host identity (0: no share)
  // and the share's link word.
  uint64_t host() const { return share_ != nullptr ? HostId() : 0; }
  uint64_t word() const { return share_ != nullptr ? share_->LinkWord() : 0; }
  // kFailedPrecondition when links must stay on this host and the peer's
  // parameters say it is elsewhere.
  absl::Status CheckPeer(uint64_t peer_host) const;
  // A new link's sharing, from the peer's parameters.
  LinkShare Learn(uint64_t peer_host, uint64_t peer_word) const;

  // Names [offset, +length) of the local region exported as `local` for the
  // link's peer: fills `ref` and returns the request's flags (kViaRef, and
  // kRefSecondKind); 0 when the bytes must travel instead.
  uint16_t Name(const LinkShare& link, const HostShare::Export* local, uint64_t offset,
                uint64_t length, ShareRef* ref) const;
  // Serves a peer's request by reference (`flags` its header's): copies
  // `length` bytes between `target` (on CUDA device `device`, -1: host) and
  // the peer's memory, into `target` when `write`. OK once in place;
  // kInvalidArgument for a bad reference (refused); any other error: not
  // served here (the requester sends the bytes).
  absl::Status Copy(LinkShare& link, uint16_t flags, const ShareRef& ref, bool write, char* target,
                    int device, uint64_t length) const;

 private:
  const std::shared_ptr<HostShare> share_;
  const bool same_host_only_;
  const std::string kind_;
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_REF_CARRIER_H_
