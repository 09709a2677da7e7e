// Small, status-returning socket helpers shared by the handshake and the TCP
// transport: host:port parsing (IPv4, hostnames, bracketed IPv6), listening
// on a port or the first free port of a range (bind and keep: no
// check-then-bind race), connecting with a timeout, and whole-buffer reads
// and writes with a deadline.
#ifndef KVFERRY_NET_SOCKET_H_
#define KVFERRY_NET_SOCKET_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvferry {
namespace net {

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset();

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;  // IPv4/IPv6 literal (no brackets) or a hostname
  uint16_t port = 0;
  // "host:port", with brackets around IPv6 literals.
  std::string ToString() const;
};

// Parses "host:port", "[v6]:port". kInvalidArgument with the accepted forms
// on anything else (missing port, port above 65535, unbracketed IPv6).
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text);

// A resolved socket address.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family() const { return storage.ss_family; }
  uint16_t port() const;
  // "1.2.3.4:5" or "[::1]:5".
  std::string ToString() const;
};

// Resolves a host (literal or name) and port. kNotFound when the name does
// not resolve, with the resolver's message.
absl::StatusOr<std::vector<SocketAddress>> Resolve(const std::string& host, uint16_t port);

struct PortRange {
  uint16_t first = 15000;
  uint16_t last = 17000;
};

struct ListeningSocket {
  Fd fd;
  SocketAddress address;  // what it is bound to, with the real port
};

// Listens on `bind_host` (an IP literal; "0.0.0.0" or "::" for all
// interfaces). `port` > 0: exactly that port. `port` == 0: the first free
// port of `range`, starting at a per-process offset so that many engines
// starting together rarely collide; a port is taken by binding it and
// keeping the socket, so two engines never get the same one. A range of
// {0, 0} lets the kernel pick any free port.
// kResourceExhausted when the whole range is taken.
absl::StatusOr<ListeningSocket> Listen(const std::string& bind_host, uint16_t port, PortRange range,
                                       int backlog = 128);

// Accepts one connection, waiting up to `timeout`. kDeadlineExceeded when
// none arrives.
absl::StatusOr<Fd> Accept(int listen_fd, absl::Duration timeout);

// Connects to `peer`, trying each address it resolves to, within `timeout`
// in total. kUnavailable (refused, unreachable, timed out) naming the peer;
// when every address refused the connection (nothing listens there: a
// certain sign that the process is gone), ConnectionRefused() says so.
absl::StatusOr<Fd> Connect(const HostPort& peer, absl::Duration timeout);
bool ConnectionRefused(const absl::Status& status);
// Marks `status` as a refused connection (kept by kvferry::Annotate).
absl::Status MarkRefused(absl::Status status);
// Starts connecting to `peer`'s first address and returns at once: a
// non-blocking socket (TCP_NODELAY on), connected or on its way (a failure
// shows at its first read or write).
absl::StatusOr<Fd> ConnectStart(const HostPort& peer);

// Writes/reads exactly `n` bytes before `deadline`. A peer that closes the
// connection gives kUnavailable; the deadline gives kDeadlineExceeded.
absl::Status WriteFull(int fd, const void* data, size_t n, absl::Time deadline);
// WriteFull of the buffers iov[0, count) in order, gathered (sendmsg, at
// most IOV_MAX of them a call). Advances `iov` in place as it sends.
absl::Status WriteFullV(int fd, iovec* iov, size_t count, absl::Time deadline);
// Drops the first `skip` bytes of the buffers iov[0, count) (sent already),
// and the empty buffers then in front: `iov` and `count` move past them,
// and the buffer a send stopped in starts where it stopped.
template <typename Count>
void SkipBytes(iovec*& iov, Count& count, size_t skip) {
  while (count > 0 && skip >= iov->iov_len) {
    skip -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0 && skip > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + skip;
    iov->iov_len -= skip;
  }
}
absl::Status ReadFull(int fd, void* data, size_t n, absl::Time deadline);

// TCP_NODELAY, and keepalive probes that give up on a dead peer after about
// `dead_after`.
absl::Status SetNoDelay(int fd);
absl::Status SetKeepAlive(int fd, absl::Duration dead_after);
// Clears O_NONBLOCK.
absl::Status SetBlocking(int fd);

// A random 64-bit value from the kernel (engine ids, nonces).
uint64_t RandomU64();

}  // namespace net
}  // namespace kvferry

#endif  // KVFERRY_NET_SOCKET_H_
