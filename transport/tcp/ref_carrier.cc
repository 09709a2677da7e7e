#include "transport/tcp/ref_carrier.h"

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

uint64_t HostId() {
  static const uint64_t id = [] {
    FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == nullptr) return uint64_t{0};
    char buf[64] = {};
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(buf[i])) * 1099511628211ull;
    return n > 0 ? h : 0;
  }();
  return id;
}

absl::Status RefCarrier::CheckPeer(uint64_t peer_host) const {
  if (!same_host_only_ || peer_host == HostId()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(kind_, " links join two engines on one host; the peer is on another"));
}

LinkShare RefCarrier::Learn(uint64_t peer_host, uint64_t peer_word) const {
  LinkShare s;
  s.same_host = host() != 0 && peer_host == host();
  if (!s.same_host) return s;
  s.peer_word = peer_word;
  s.imports = share_->NewImports(peer_word);
  return s;
}

uint16_t RefCarrier::Name(const LinkShare& link, const HostShare::Export* local, uint64_t offset,
                          uint64_t length, ShareRef* ref) const {
  if (!link.same_host || !link.ok || length == 0 || local == nullptr) return 0;
  bool second_kind = false;
  if (!share_->Name(*local, offset, link.peer_word, ref, &second_kind)) return 0;
  return second_kind ? tcp_wire::kViaRef | tcp_wire::kRefSecondKind : tcp_wire::kViaRef;
}

absl::Status RefCarrier::Copy(LinkShare& link, uint16_t flags, const ShareRef& ref, bool write,
                              char* target, int device, uint64_t length) const {
  // Only a peer on this host, over a link whose ends both have a host
  // share, sends references; anything else is served the ordinary way (the
  // requester sends it again with its bytes), never opened here.
  if (link.imports == nullptr) {
    return absl::UnavailableError(
        "this end takes no references on this link (not the same host, or no host share)");
  }
  return share_->Copy(*link.imports, ref, (flags & tcp_wire::kRefSecondKind) != 0, write, target,
                      device, length);
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
