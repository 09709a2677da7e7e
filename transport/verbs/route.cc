#include "transport/verbs/route.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "transport/verbs/ibv.h"

namespace kvferry {
namespace transport {
namespace verbs {
namespace {

// Owns an event channel and an id; destroys them in the right order.
struct CmSession {
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* id = nullptr;
  ~CmSession() {
    if (id != nullptr) ibv::Cm().destroy_id(id);
    if (channel != nullptr) ibv::Cm().destroy_event_channel(channel);
  }
};

// Waits for the next event on the channel; it must be `want`.
absl::Status Await(rdma_event_channel* channel, rdma_cm_event_type want, const std::string& peer,
                   absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  pollfd pfd{channel->fd, POLLIN, 0};
  const int ready = ms > 0 ? ::poll(&pfd, 1, static_cast<int>(ms)) : 0;
  if (ready < 0) return ErrnoError(errno, "poll rdma_cm channel");
  if (ready == 0) {
    return absl::UnavailableError(
        absl::StrCat("rdma_cm: no ", ibv::Cm().event_str(want), " for ", peer, " in time"));
  }
  rdma_cm_event* event = nullptr;
  if (ibv::Cm().get_cm_event(channel, &event) != 0) return ErrnoError(errno, "rdma_get_cm_event");
  const rdma_cm_event_type got = event->event;
  const int status = event->status;
  ibv::Cm().ack_cm_event(event);
  if (got != want) {
    return absl::UnavailableError(absl::StrCat("rdma_cm: ", ibv::Cm().event_str(got), " resolving ",
                                               peer, " (status ", status, ")"));
  }
  return absl::OkStatus();
}

// `ip` as a socket address.
absl::StatusOr<sockaddr_storage> AddressOf(const std::string& ip) {
  sockaddr_storage dst{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&dst);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&dst);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
  } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("route: \"", ip, "\" is not an IPv4 or IPv6 address"));
  }
  return dst;
}

// The text form of `addr`'s IP ("" for another family).
std::string TextOf(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

}  // namespace

absl::StatusOr<Route> ResolveRoute(const std::string& peer_ip, absl::Duration timeout) {
  ASSIGN_OR_RETURN(sockaddr_storage dst, AddressOf(peer_ip));
  const absl::Time deadline = absl::Now() + timeout;
  const int ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  if (absl::Status loaded = ibv::LoadRdmacm(); !loaded.ok()) {
    return absl::UnavailableError(absl::StrCat("rdma_cm unavailable (", loaded.message(), ")"));
  }
  const ibv::Rdmacm& cm = ibv::Cm();
  CmSession s;
  s.channel = cm.create_event_channel();
  if (s.channel == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "rdma_cm unavailable (rdma_create_event_channel: ", std::strerror(errno), ")"));
  }
  if (cm.create_id(s.channel, &s.id, nullptr, RDMA_PS_TCP) != 0) {
    s.id = nullptr;
    return absl::UnavailableError(
        absl::StrCat("rdma_cm unavailable (rdma_create_id: ", std::strerror(errno), ")"));
  }
  if (cm.resolve_addr(s.id, nullptr, reinterpret_cast<sockaddr*>(&dst), ms) != 0) {
    return absl::UnavailableError(
        absl::StrCat("rdma_resolve_addr ", peer_ip, ": ", std::strerror(errno)));
  }
  if (absl::Status st = Await(s.channel, RDMA_CM_EVENT_ADDR_RESOLVED, peer_ip, deadline);
      !st.ok()) {
    return st;
  }
  if (cm.resolve_route(s.id, ms) != 0) {
    return absl::UnavailableError(
        absl::StrCat("rdma_resolve_route ", peer_ip, ": ", std::strerror(errno)));
  }
  if (absl::Status st = Await(s.channel, RDMA_CM_EVENT_ROUTE_RESOLVED, peer_ip, deadline);
      !st.ok()) {
    return st;
  }
  if (s.id->verbs == nullptr) {
    return absl::UnavailableError(absl::StrCat("rdma_cm resolved ", peer_ip, " without a device"));
  }
  Route route;
  route.device = ibv::DeviceName(s.id->verbs->device);
  route.port = s.id->port_num;
  route.source_ip = TextOf(rdma_get_local_addr(s.id));  // inline in rdma_cma.h
  return route;
}

absl::StatusOr<size_t> PortForRoute(const Route& route, const std::vector<SelectedPort>& ports) {
  for (size_t i = 0; i < ports.size(); ++i) {
    if (ports[i].device == route.device && ports[i].port == route.port) return i;
  }
  return absl::NotFoundError(absl::StrCat("the route leaves from ", route.device, ":", route.port,
                                          ", which is not among the selected ports"));
}

std::string Ipv4OfGid(const std::string& gid) {
  std::vector<std::string> groups = absl::StrSplit(gid, ':');
  if (groups.size() != 8) return "";
  for (int i = 0; i < 5; ++i) {
    if (groups[i] != "0000") return "";
  }
  if (groups[5] != "ffff") return "";
  unsigned hi = 0, lo = 0;
  if (groups[6].size() != 4 || groups[7].size() != 4 ||
      std::sscanf(groups[6].c_str(), "%4x", &hi) != 1 ||
      std::sscanf(groups[7].c_str(), "%4x", &lo) != 1) {
    return "";
  }
  return absl::StrCat(hi >> 8, ".", hi & 0xff, ".", lo >> 8, ".", lo & 0xff);
}

const absl::StatusOr<uint32_t>* RouteCache::Find(const std::string& ip, absl::Time now) const {
  auto it = entries_.find(ip);
  if (it == entries_.end() || now >= it->second.expires) return nullptr;
  return &it->second.answer;
}

void RouteCache::Put(const std::string& ip, absl::StatusOr<uint32_t> answer, absl::Time now) {
  const absl::Time expires = now + (answer.ok() ? kRouteTtl : kRouteFailureTtl);
  entries_[ip] = Entry{std::move(answer), expires};
}

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry
