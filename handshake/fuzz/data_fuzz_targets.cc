#include "handshake/fuzz/data_fuzz_targets.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "handshake/fuzz/check.h"
#include "net/socket.h"
#include "transport/cuda_ipc/vmm_share.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace handshake {
namespace {

constexpr size_t kRegion = 64 << 10;
constexpr char kGuard = static_cast<char>(0xa5);

// One transport for the whole run, with a writable region between guards
// and a read-only one.
struct Target {
  std::unique_ptr<transport::Transport> t;
  std::vector<char> memory = std::vector<char>(3 * kRegion, kGuard);
  std::vector<char> read_only = std::vector<char>(kRegion, 'r');
  transport::Region writable, readable;
  net::HostPort data;
  uint64_t token = 0;
};

Target& The() {
  static Target* target = [] {
    auto* s = new Target;
    transport::TcpTransportOptions o;
    o.bind_host = "127.0.0.1";
    o.in_process_shortcut = false;
    o.connect_timeout = absl::Seconds(2);
    auto t = transport::CreateTcpTransport(o);
    Check(t.ok(), "cannot make the TCP transport");
    s->t = std::move(*t);
    auto w = s->t->RegisterMemory(s->memory.data() + kRegion, kRegion,
                                  transport::Access::kRemoteReadWrite);
    auto r = s->t->RegisterMemory(s->read_only.data(), kRegion, transport::Access::kRemoteRead);
    Check(w.ok() && r.ok(), "cannot register the regions");
    s->writable = *w;
    s->readable = *r;
    auto hp = net::ParseHostPort(s->t->LocalEndpoint().nics[0].address);
    Check(hp.ok(), "the data address does not parse");
    s->data = *hp;
    return s;
  }();
  return *target;
}

void Replace(std::string* bytes, const char (&mark)[9], uint64_t value) {
  for (size_t at = bytes->find(mark, 0, 8); at != std::string::npos;
       at = bytes->find(mark, at + 8, 8)) {
    std::memcpy(&(*bytes)[at], &value, 8);
  }
}

// Writes `bytes` and reads what comes back, until the peer closes or
// nothing moves for a while.
void Exchange(int fd, const std::string& bytes) {
  size_t sent = 0;
  bool closed_write = false;
  char sink[16 << 10];
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (absl::Now() < deadline) {
    if (sent == bytes.size() && !closed_write) {
      ::shutdown(fd, SHUT_WR);
      closed_write = true;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (closed_write ? 0 : POLLOUT)), 0};
    if (::poll(&p, 1, 50) <= 0) {
      if (closed_write) return;  // quiet: what it had to say is said
      continue;
    }
    if ((p.revents & POLLIN) != 0) {
      const ssize_t got = ::recv(fd, sink, sizeof sink, 0);
      if (got <= 0) return;
    }
    if ((p.revents & POLLOUT) != 0 && !closed_write) {
      const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0) return;  // it closed the link
      sent += static_cast<size_t>(n);
    }
    if ((p.revents & (POLLERR | POLLHUP)) != 0) return;
  }
}

}  // namespace

void FuzzDataStream(const uint8_t* data, size_t size) {
  Target& s = The();
  std::string bytes(reinterpret_cast<const char*>(data), size);
  Replace(&bytes, "RKEY____", s.writable.keys[0]);
  Replace(&bytes, "ADDR____", s.writable.addr);
  Replace(&bytes, "ROKEY___", s.readable.keys[0]);
  Replace(&bytes, "ROADDR__", s.readable.addr);
  const uint64_t token = ++s.token;
  auto fd = net::Connect(s.data, absl::Seconds(2));
  Check(fd.ok(), "cannot connect to the data port");
  const std::string hello = transport::EncodeHello(token, "");
  Check(net::WriteFull(fd->get(), hello.data(), hello.size(), absl::Now() + absl::Seconds(2)).ok(),
        "cannot send the hello");
  const transport::NicInfo peer{"lo", "127.0.0.1:1", 0, 0, 0};
  auto link = s.t->AcceptLink(0, peer, transport::tcp_wire::EncodeLinkParams(token, 0, 0));
  Check(link.ok(), "the link was not accepted");
  Exchange(fd->get(), bytes);
  fd->Reset();
  Check(s.t->CloseLink(link->link).ok(), "the link did not close");
  // Drain what the link's end left (its completions are none: it posted
  // nothing), then check the memory.
  for (size_t i = 0; i < kRegion; ++i) {
    Check(s.memory[i] == kGuard && s.memory[2 * kRegion + i] == kGuard,
          "a byte outside the writable region changed");
    Check(s.read_only[i] == 'r', "the read-only region changed");
  }
}

void FuzzVmmReply(const uint8_t* data, size_t size) {
  int sv[2];
  Check(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
  // Small inputs fit the socket buffer: written whole, then the end closes.
  size_t off = 0;
  while (off < size) {
    const ssize_t n = ::send(sv[0], data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  ::close(sv[0]);
  std::vector<uint64_t> sizes;
  std::vector<int> fds;
  const absl::Status read = transport::ReadVmmReply(sv[1], &sizes, &fds);
  for (int fd : fds) ::close(fd);
  ::close(sv[1]);
  // Nothing sends descriptors here: no reply can be complete.
  Check(!read.ok(), "a VMM reply without descriptors was accepted");
}

void FuzzVmmRequest(const uint8_t* data, size_t size) {
  transport::VmmServer* server = transport::VmmServer::Get();
  Check(server != nullptr, "the VMM server did not start");
  absl::StatusOr<net::Fd> fd = transport::ConnectVmmServer(server->name());
  Check(fd.ok(), "the VMM server does not take connections");
  if (size > 0) {
    (void)::send(fd->get(), data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  ::shutdown(fd->get(), SHUT_WR);
  std::vector<uint64_t> sizes;
  std::vector<int> fds;
  const absl::Status read = transport::ReadVmmReply(fd->get(), &sizes, &fds);
  for (int d : fds) ::close(d);
  Check(!read.ok(), "the VMM server answered with chunks for an export it does not have");
}

}  // namespace handshake
}  // namespace kvferry
