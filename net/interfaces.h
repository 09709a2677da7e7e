// Which address should this engine advertise? Reads the host's interfaces
// and default route (no configuration) and decides, with a reason a person
// can read in the log:
//   explicit host > IP of the chosen RDMA netdev > IP of the default-route
//   interface > first up non-loopback interface > loopback.
#ifndef KVFERRY_NET_INTERFACES_H_
#define KVFERRY_NET_INTERFACES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvferry {
namespace net {

struct InterfaceAddress {
  std::string name;  // "eth0"
  std::string ip;    // "192.0.2.2" or "2001:db8::1" (no brackets)
  int family = 0;    // AF_INET or AF_INET6
  bool up = false;
  bool loopback = false;
};

// Every address of every interface (getifaddrs), IPv6 link-local excluded.
absl::StatusOr<std::vector<InterfaceAddress>> ListInterfaceAddresses();

// The interface of the IPv4 default route from `<proc_root>/net/route`, or
// "" when there is none (or the file cannot be read).
std::string DefaultRouteInterface(const std::string& proc_root = "/proc");

struct HostChoice {
  std::string host;
  std::string reason;
};

// True for addresses only this host can reach: 127.0.0.0/8, ::1 and
// "localhost".
bool IsLoopbackHost(const std::string& host);

// Whether `host` (an address, as in "host:port") names this host: loopback
// (IsLoopbackHost), or equal to one of `addresses` (this host's, read once).
bool IsThisHost(const std::string& host, const std::vector<InterfaceAddress>& addresses);

// Applies the order above. Within one interface IPv4 is preferred.
HostChoice ChooseLocalHost(const std::string& explicit_host, const std::string& rdma_netdev,
                           const std::vector<InterfaceAddress>& addresses,
                           const std::string& default_route_interface);

}  // namespace net
}  // namespace kvferry

#endif  // KVFERRY_NET_INTERFACES_H_
