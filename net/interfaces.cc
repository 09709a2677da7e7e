#include "net/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"

namespace kvferry {
namespace net {
namespace {

// The best address of interface `name`: IPv4 first, then IPv6.
const InterfaceAddress* BestOf(const std::vector<InterfaceAddress>& addresses,
                               const std::string& name) {
  const InterfaceAddress* best = nullptr;
  for (const InterfaceAddress& a : addresses) {
    if (a.name != name || !a.up) continue;
    if (best == nullptr || (a.family == AF_INET && best->family != AF_INET)) best = &a;
  }
  return best;
}

}  // namespace

absl::StatusOr<std::vector<InterfaceAddress>> ListInterfaceAddresses() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return LastErrnoError("getifaddrs");
  std::vector<InterfaceAddress> out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    } else {
      const in6_addr& a6 = reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(&a6)) continue;  // needs a scope id; never advertised
      inet_ntop(AF_INET6, &a6, buf, sizeof buf);
    }
    out.push_back(InterfaceAddress{i->ifa_name, buf, family, (i->ifa_flags & IFF_UP) != 0,
                                   (i->ifa_flags & IFF_LOOPBACK) != 0});
  }
  ::freeifaddrs(list);
  return out;
}

std::string DefaultRouteInterface(const std::string& proc_root) {
  std::ifstream route(proc_root + "/net/route");
  std::string line;
  std::getline(route, line);  // header
  while (std::getline(route, line)) {
    std::istringstream fields(line);
    std::string iface, destination, gateway, flags, refcnt, use, metric, mask;
    if (!(fields >> iface >> destination >> gateway >> flags >> refcnt >> use >> metric >> mask)) {
      continue;
    }
    // Destination and mask 0: the default route. Flag 0x1: the route is up.
    if (destination == "00000000" && mask == "00000000" &&
        (std::stoul(flags, nullptr, 16) & 0x1) != 0) {
      return iface;
    }
  }
  return "";
}

HostChoice ChooseLocalHost(const std::string& explicit_host, const std::string& rdma_netdev,
                           const std::vector<InterfaceAddress>& addresses,
                           const std::string& default_route_interface) {
  if (!explicit_host.empty()) return {explicit_host, "set explicitly"};
  if (!rdma_netdev.empty()) {
    if (const InterfaceAddress* a = BestOf(addresses, rdma_netdev)) {
      return {a->ip,
              absl::StrCat("address of ", rdma_netdev, ", the netdev of the chosen RDMA device")};
    }
  }
  if (!default_route_interface.empty()) {
    if (const InterfaceAddress* a = BestOf(addresses, default_route_interface)) {
      return {a->ip, absl::StrCat("address of ", default_route_interface,
                                  ", the interface of the default route")};
    }
  }
  for (int family : {AF_INET, AF_INET6}) {
    for (const InterfaceAddress& a : addresses) {
      if (a.up && !a.loopback && a.family == family) {
        return {a.ip,
                absl::StrCat("first up non-loopback interface (", a.name, "); no default route")};
      }
    }
  }
  return {"127.0.0.1", "no usable network interface; loopback only"};
}

bool IsLoopbackHost(const std::string& host) {
  in_addr v4;
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6);
  }
  return host == "localhost";
}

bool IsThisHost(const std::string& host, const std::vector<InterfaceAddress>& addresses) {
  if (IsLoopbackHost(host)) return true;
  for (const InterfaceAddress& a : addresses) {
    if (a.ip == host) return true;
  }
  return false;
}

}  // namespace net
}  // namespace kvferry
