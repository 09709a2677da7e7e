// Route-aware pairing through librdmacm: which local RDMA device, port and
// source address actually reach a peer's IP address. The cure for hosts
// whose NICs sit in separate route groups (only one NIC reaches a given
// peer subnet) and for peers whose NICs do not match ours one to one.
//
// rdma_cm needs the kernel's rdma_ucm module and an IP on the RoCE netdev;
// it does not resolve over Soft-RoCE on `lo`. Every failure is an error with
// the reason, and callers fall back to discovery's GID ranking (and log why).
#ifndef KVFERRY_TRANSPORT_VERBS_ROUTE_H_
#define KVFERRY_TRANSPORT_VERBS_ROUTE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/verbs/discovery.h"

namespace kvferry {
namespace transport {
namespace verbs {

struct Route {
  std::string device;  // "mlx5_0"
  uint32_t port = 0;
  std::string source_ip;  // the local address the route leaves from
};

// Resolves the address and route to `peer_ip` (IPv4 or IPv6 literal) with
// rdma_cm, waiting at most `timeout`. kUnavailable when rdma_cm is missing
// or cannot resolve (the message says which step failed and errno),
// kInvalidArgument for a malformed address.
absl::StatusOr<Route> ResolveRoute(const std::string& peer_ip,
                                   absl::Duration timeout = absl::Seconds(2));

// The index in `ports` of the port `route` leaves from; kNotFound (naming
// the route) when it is not among them, e.g. excluded by --devices.
absl::StatusOr<size_t> PortForRoute(const Route& route, const std::vector<SelectedPort>& ports);

// The IPv4 address inside an IPv4-mapped GID written as 8 groups of 4 hex
// digits ("0000:...:ffff:0a00:0a01" -> "10.0.10.1"); "" for any other GID.
std::string Ipv4OfGid(const std::string& gid);

// Route answers per peer IP, so that rdma_cm is asked once per peer, not
// per link. An answer expires: a route found after kRouteTtl (routes
// change), a failure after kRouteFailureTtl (rdma_ucm loaded later, an IP
// added to the netdev, a peer subnet that came up). Not thread-safe.
class RouteCache {
 public:
  static constexpr absl::Duration kRouteTtl = absl::Minutes(10);
  static constexpr absl::Duration kRouteFailureTtl = absl::Seconds(30);
  // The answer for `ip` still valid at `now`, or null.
  const absl::StatusOr<uint32_t>* Find(const std::string& ip, absl::Time now) const;
  void Put(const std::string& ip, absl::StatusOr<uint32_t> answer, absl::Time now);

 private:
  struct Entry {
    absl::StatusOr<uint32_t> answer;
    absl::Time expires;
  };
  std::map<std::string, Entry> entries_;
};

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_ROUTE_H_
