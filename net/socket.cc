#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/errno_status.h"

namespace kvferry {
namespace net {
namespace {

int PollMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  if (left > absl::Hours(1)) return 3600 * 1000;
  return static_cast<int>(
      absl::ToInt64Milliseconds(left + absl::Milliseconds(1) - absl::Nanoseconds(1)));
}

// Waits for `events` on fd until `deadline`. OK, or kDeadlineExceeded.
absl::Status WaitFor(int fd, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ms = PollMs(deadline);
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return absl::OkStatus();
    if (r == 0) {
      if (ms == 0 || absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
      }
      continue;
    }
    if (errno != EINTR) return ErrnoError(errno, absl::StrCat("poll for ", what));
  }
}

}  // namespace

void Fd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

// What is wrong with `text`, whose host part `host` holds a ':'.
static std::string ColonsInHost(absl::string_view text, const std::string& host) {
  in6_addr a;
  const std::string whole(text);
  const bool whole_is_ipv6 = inet_pton(AF_INET6, whole.c_str(), &a) == 1;
  const bool host_is_ipv6 = inet_pton(AF_INET6, host.c_str(), &a) == 1;
  if (host_is_ipv6) {
    return absl::StrCat(
        "an IPv6 address goes in brackets: [", host, "]", text.substr(host.size()),
        whole_is_ipv6 ? absl::StrCat(", or [", text, "]:PORT if all of it is the address") : "");
  }
  if (whole_is_ipv6) {
    return absl::StrCat("'", text, "' is an IPv6 address without a port: write it as [", text,
                        "]:PORT");
  }
  return absl::StrCat("more than one ':' and '", host,
                      "' is not an IPv6 address (a port given twice?)");
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad peer address '", text, "': ", why,
                     " (expected host:port, 1.2.3.4:15000 or [::1]:15000)"));
  };
  HostPort hp;
  absl::string_view port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) return bad("an IPv6 address in brackets needs its ']'");
    hp.host = std::string(text.substr(1, close - 1));
    absl::string_view rest = text.substr(close + 1);
    if (rest.empty() || rest.front() != ':') return bad("missing port");
    port = rest.substr(1);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return bad("missing port");
    hp.host = std::string(text.substr(0, colon));
    if (hp.host.find(':') != std::string::npos) return bad(ColonsInHost(text, hp.host));
    port = text.substr(colon + 1);
  }
  if (hp.host.empty()) return bad("empty host");
  uint32_t p;
  if (port.empty() || !absl::SimpleAtoi(port, &p) || p > 65535 ||
      port.find_first_not_of("0123456789") != absl::string_view::npos) {
    return bad("port must be a number from 0 to 65535");
  }
  hp.port = static_cast<uint16_t>(p);
  return hp;
}

uint16_t SocketAddress::port() const {
  if (family() == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
}

std::string SocketAddress::ToString() const {
  char buf[INET6_ADDRSTRLEN] = {};
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof buf);
    return absl::StrCat(buf, ":", port());
  }
  inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof buf);
  return absl::StrCat("[", buf, "]:", port());
}

absl::StatusOr<std::vector<SocketAddress>> Resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    SocketAddress a;
    std::memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.length = ai->ai_addrlen;
    out.push_back(a);
  }
  ::freeaddrinfo(result);
  if (out.empty()) return absl::NotFoundError(absl::StrCat("no address for '", host, "'"));
  return out;
}

namespace {

// Binds and listens on one address; the errno of a failure is returned in
// the status message and `*in_use` tells whether the port was taken.
absl::StatusOr<ListeningSocket> ListenOn(SocketAddress addr, int backlog, bool* in_use) {
  *in_use = false;
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return LastErrnoError("socket");
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (addr.family() == AF_INET6) {
    // "::" means every interface, IPv4 included (dual stack); a specific
    // IPv6 address takes IPv6 only.
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&addr.storage)->sin6_addr;
    const int v6only = IN6_IS_ADDR_UNSPECIFIED(&a) ? 0 : 1;
    if (::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only) != 0) {
      return LastErrnoError("setsockopt IPV6_V6ONLY");
    }
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr.storage), addr.length) != 0 ||
      ::listen(fd.get(), backlog) != 0) {
    const int err = errno;
    *in_use = err == EADDRINUSE;
    return ErrnoError(err, absl::StrCat("listen on ", addr.ToString()));
  }
  ListeningSocket out;
  out.address.length = sizeof out.address.storage;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&out.address.storage), &out.address.length);
  out.fd = std::move(fd);
  return out;
}

}  // namespace

absl::StatusOr<ListeningSocket> Listen(const std::string& bind_host, uint16_t port, PortRange range,
                                       int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(bind_host.c_str(), "0", &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot listen on '", bind_host, "': not an IP address (", gai_strerror(rc), ")"));
  }
  SocketAddress base;
  std::memcpy(&base.storage, result->ai_addr, result->ai_addrlen);
  base.length = result->ai_addrlen;
  ::freeaddrinfo(result);
  auto with_port = [&](uint16_t p) {
    SocketAddress a = base;
    if (a.family() == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = htons(p);
    } else {
      reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = htons(p);
    }
    return a;
  };
  bool in_use = false;
  if (port != 0) return ListenOn(with_port(port), backlog, &in_use);
  if (range.first == 0 && range.last == 0) {
    return ListenOn(with_port(0), backlog, &in_use);  // the kernel's choice
  }
  if (range.first == 0 || range.last < range.first) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port range ", range.first, "-", range.last));
  }
  const uint32_t span = uint32_t{range.last} - range.first + 1;
  // Start somewhere different in each process so that engines starting at
  // once mostly find a free port on the first try.
  const uint32_t start = static_cast<uint32_t>(::getpid() * 7919u) % span;
  absl::Status last;
  for (uint32_t i = 0; i < span; ++i) {
    const uint16_t p = static_cast<uint16_t>(range.first + (start + i) % span);
    auto s = ListenOn(with_port(p), backlog, &in_use);
    if (s.ok()) return s;
    if (!in_use) return s.status();  // a real error, not a taken port
    last = s.status();
  }
  return absl::ResourceExhaustedError(absl::StrCat("every port from ", range.first, " to ",
                                                   range.last, " on ", bind_host, " is taken (",
                                                   last.message(), ")"));
}

absl::StatusOr<Fd> Accept(int listen_fd, absl::Duration timeout) {
  absl::Status ready = WaitFor(listen_fd, POLLIN, absl::Now() + timeout, "accept");
  if (!ready.ok()) return ready;
  Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) return LastErrnoError("accept");
  return fd;
}

namespace {
constexpr char kRefusedUrl[] = "kvferry.net/connection-refused";
}  // namespace

bool ConnectionRefused(const absl::Status& status) {
  return status.GetPayload(kRefusedUrl).has_value();
}

absl::Status MarkRefused(absl::Status status) {
  if (!status.ok()) status.SetPayload(kRefusedUrl, absl::Cord("1"));
  return status;
}

absl::StatusOr<Fd> Connect(const HostPort& peer, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto addrs = Resolve(peer.host, peer.port);
  if (!addrs.ok()) return addrs.status();
  absl::Status last;
  bool all_refused = true;
  for (const SocketAddress& a : *addrs) {
    Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return LastErrnoError("socket");
    const std::string what = absl::StrCat("connect ", peer.ToString());
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0) {
      if (errno != EINPROGRESS) {
        all_refused = all_refused && errno == ECONNREFUSED;
        last = absl::UnavailableError(ErrnoError(errno, what).message());
        continue;
      }
      absl::Status ready = WaitFor(fd.get(), POLLOUT, deadline, what);
      if (!ready.ok()) {
        all_refused = false;
        last = absl::UnavailableError(ready.message());
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        all_refused = all_refused && err == ECONNREFUSED;
        last = absl::UnavailableError(ErrnoError(err, what).message());
        continue;
      }
    }
    // Back to blocking mode; reads and writes use poll deadlines.
    (void)SetBlocking(fd.get());
    return fd;
  }
  return all_refused ? MarkRefused(last) : last;
}

absl::StatusOr<Fd> ConnectStart(const HostPort& peer) {
  absl::StatusOr<std::vector<SocketAddress>> addrs = Resolve(peer.host, peer.port);
  if (!addrs.ok()) return addrs.status();
  if (addrs->empty()) return absl::UnavailableError(absl::StrCat("no address for ", peer.host));
  const SocketAddress& a = addrs->front();
  Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return LastErrnoError("socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0 &&
      errno != EINPROGRESS) {
    return absl::UnavailableError(
        ErrnoError(errno, absl::StrCat("connect ", peer.ToString())).message());
  }
  (void)SetNoDelay(fd.get());
  return fd;
}

absl::Status WriteFull(int fd, const void* data, size_t n, absl::Time deadline) {
  iovec v{const_cast<void*>(data), n};
  return WriteFullV(fd, &v, 1, deadline);
}

absl::Status WriteFullV(int fd, iovec* iov, size_t count, absl::Time deadline) {
  for (SkipBytes(iov, count, 0); count > 0;) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
    const ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      SkipBytes(iov, count, static_cast<size_t>(w));
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      absl::Status ready = WaitFor(fd, POLLOUT, deadline, "send");
      if (!ready.ok()) return ready;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    return absl::UnavailableError(ErrnoError(errno, "send").message());
  }
  return absl::OkStatus();
}

absl::Status ReadFull(int fd, void* data, size_t n, absl::Time deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("peer closed the connection");
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      absl::Status ready = WaitFor(fd, POLLIN, deadline, "receive");
      if (!ready.ok()) return ready;
      continue;
    }
    if (errno == EINTR) continue;
    return absl::UnavailableError(ErrnoError(errno, "recv").message());
  }
  return absl::OkStatus();
}

absl::Status SetBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return LastErrnoError("fcntl O_NONBLOCK");
  }
  return absl::OkStatus();
}

absl::Status SetNoDelay(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
    return LastErrnoError("setsockopt TCP_NODELAY");
  }
  return absl::OkStatus();
}

absl::Status SetKeepAlive(int fd, absl::Duration dead_after) {
  const int one = 1;
  const int idle = std::max<int>(1, absl::ToInt64Seconds(dead_after) / 2);
  const int interval = std::max<int>(1, idle / 3);
  const int count = 3;
  const unsigned user_timeout = static_cast<unsigned>(absl::ToInt64Milliseconds(dead_after));
  if (::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout) != 0) {
    return LastErrnoError("setsockopt keepalive");
  }
  return absl::OkStatus();
}

uint64_t RandomU64() {
  uint64_t v = 0;
  while (::getrandom(&v, sizeof v, 0) != sizeof v) {
  }
  return v;
}

}  // namespace net
}  // namespace kvferry
