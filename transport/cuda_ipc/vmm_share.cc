#include "transport/cuda_ipc/vmm_share.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "cuda/driver.h"

namespace kvferry {
namespace transport {
namespace {

constexpr uint64_t kMagic = 0x31306d6d7666766bull;  // "kvfvmm01"
constexpr size_t kFdsPerMessage = 64;

struct Request {
  uint64_t magic;
  uint64_t id;
};
struct Reply {
  uint32_t code;    // absl::StatusCode; 0: the chunks follow
  uint32_t count;   // chunks
  uint64_t offset;  // the region's start in the first chunk
  uint64_t length;  // the region's length
  char text[104];   // why not, NUL-terminated
};
static_assert(sizeof(Reply) == 128, "VMM reply size");

sockaddr_un Address(uint64_t name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = absl::StrFormat("kvferry-vmm-%016x", name);
  std::memcpy(a.sun_path + 1, path.data(), path.size());  // abstract: leading NUL
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  return a;
}

void SetTimeouts(int fd) {
  timeval tv{};
  tv.tv_sec = absl::ToInt64Seconds(kVmmTimeout);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Sends `n` bytes and, with the first of them, `fds`.
absl::Status SendMsg(int fd, const void* data, size_t n, const int* fds, size_t count) {
  const char* p = static_cast<const char*>(data);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(count, 1)));
  while (n > 0) {
    iovec iov{const_cast<char*>(p), n};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (count > 0) {
      msg.msg_control = control.data();
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * count);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * count);
    }
    const ssize_t sent = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return absl::UnavailableError(absl::StrCat("sendmsg: ", std::strerror(errno)));
    p += sent;
    n -= static_cast<size_t>(sent);
    count = 0;  // delivered with the first byte
  }
  return absl::OkStatus();
}

// Receives exactly `n` bytes; fds that come with them are appended to
// `fds` (at most `max_fds` in all; more is an error, and they are closed).
absl::Status RecvMsg(int fd, void* data, size_t n, std::vector<int>* fds, size_t max_fds) {
  char* p = static_cast<char*>(data);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kFdsPerMessage));
  absl::Status bad;
  while (n > 0) {
    iovec iov{p, n};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t got = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::UnavailableError(got == 0 ? std::string("the VMM server closed the connection")
                                             : absl::StrCat("recvmsg: ", std::strerror(errno)));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int one;
        std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof one);
        fds->push_back(one);
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) bad = absl::DataLossError("file descriptors were cut");
    if (fds->size() > max_fds) bad = absl::DataLossError("more file descriptors than chunks");
    p += got;
    n -= static_cast<size_t>(got);
  }
  return bad;
}

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
}

}  // namespace

VmmServer* VmmServer::Get() {
  static VmmServer* server = [] {
    auto* s = new VmmServer();
    if (absl::Status started = s->Start(); !started.ok()) {
      KVF_LOG(WARNING) << "cuda_ipc: cannot serve VMM device memory to peers on this host ("
                       << started.message() << "): they get it staged";
      delete s;
      return static_cast<VmmServer*>(nullptr);
    }
    std::atexit([] { VmmServer::Get()->Stop(); });
    return s;
  }();
  return server;
}

absl::Status VmmServer::Start() {
  listener_ = net::Fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener_.get() < 0)
    return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  for (int attempt = 0;; ++attempt) {
    name_ = net::RandomU64();
    socklen_t len;
    const sockaddr_un a = Address(name_, &len);
    if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&a), len) == 0) break;
    if (errno != EADDRINUSE || attempt == 8) {
      return absl::UnavailableError(absl::StrCat("bind: ", std::strerror(errno)));
    }
  }
  pid_ = ::getpid();
  wake_ = net::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_.valid())
    return absl::UnavailableError(absl::StrCat("eventfd: ", std::strerror(errno)));
  if (::listen(listener_.get(), 16) != 0) {
    return absl::UnavailableError(absl::StrCat("listen: ", std::strerror(errno)));
  }
  absl::StatusOr<std::thread> t = StartThread("the VMM server", [this] { Serve(); });
  if (!t.ok()) return t.status();
  thread_ = std::move(*t);
  return absl::OkStatus();
}

void VmmServer::Stop() {
  // A forked child (which has no server thread) must leave the parent's
  // socket alone: shutdown() would stop it for both.
  if (::getpid() != pid_) return;
  stopping_ = true;
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);  // wakes poll()
  if (thread_.joinable()) thread_.join();
}

uint64_t VmmServer::Add(const void* addr, uint64_t length, int ordinal) {
  MutexLock lock(&mu_);
  uint64_t id;
  do {
    id = net::RandomU64();
  } while (id == 0 || exports_.count(id) > 0);
  exports_[id] = Export{addr, length, ordinal};
  return id;
}

void VmmServer::Remove(uint64_t id) {
  MutexLock lock(&mu_);
  exports_.erase(id);
}

namespace {

// Refuses on `fd` (best effort: the client may not read).
void Refuse(int fd, absl::StatusCode code, const std::string& why) {
  Reply reply{};
  reply.code = static_cast<uint32_t>(code);
  std::snprintf(reply.text, sizeof reply.text, "%s", why.c_str());
  (void)SendMsg(fd, &reply, sizeof reply, nullptr, 0);
}

}  // namespace

// A connection whose request is still arriving.
struct VmmServer::Pending {
  net::Fd fd;
  Request req{};
  size_t got = 0;
  absl::Time deadline;
};

// One poll loop over the listener and the connections whose request is
// still arriving: a client that trickles its request (or sends none) holds
// only its own connection, for at most kVmmRequestTime, and never delays
// another's answer. Another user's connection is refused at accept.

void VmmServer::Serve() {
  // Fixed arrays, no heap: a forked child (which has no server thread)
  // inherits nothing of this loop that looks leaked.
  std::array<Pending, kMaxVmmPending> pending;
  size_t count = 0;
  std::array<pollfd, kMaxVmmPending + 2> fds;
  for (;;) {
    fds[0] = {listener_.get(), POLLIN, 0};
    fds[1] = {wake_.get(), POLLIN, 0};
    absl::Time next = absl::InfiniteFuture();
    for (size_t i = 0; i < count; ++i) {
      fds[i + 2] = {pending[i].fd.get(), POLLIN, 0};
      next = std::min(next, pending[i].deadline);
    }
    const absl::Duration wait = std::min(next - absl::Now(), absl::Seconds(1));
    (void)::poll(fds.data(), count + 2,
                 std::max<int>(0, static_cast<int>(absl::ToInt64Milliseconds(wait)) + 1));
    if (stopping_) return;
    const absl::Time now = absl::Now();
    size_t kept = 0;
    for (size_t i = 0; i < count; ++i) {
      if (Progress(pending[i], fds[i + 2].revents, now)) {
        pending[i].fd.Reset();
      } else {
        if (kept != i) pending[kept] = std::move(pending[i]);
        ++kept;
      }
    }
    count = kept;
    if ((fds[0].revents & POLLIN) != 0) AcceptOne(pending.data(), &count, now);
  }
}

bool VmmServer::Progress(Pending& p, short revents, absl::Time now) {
  if (now > p.deadline) {
    Refuse(p.fd.get(), absl::StatusCode::kDeadlineExceeded, "the VMM request came too slowly");
    return true;
  }
  if ((revents & (POLLIN | POLLHUP | POLLERR)) == 0) return false;
  const ssize_t n = ::recv(p.fd.get(), reinterpret_cast<char*>(&p.req) + p.got,
                           sizeof p.req - p.got, MSG_DONTWAIT);
  const bool gone = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
  if (gone) {
    if (p.got > 0) {
      Refuse(p.fd.get(), absl::StatusCode::kInvalidArgument, "not a VMM request (cut short)");
    }
    return true;
  }
  if (n > 0 && (p.got += static_cast<size_t>(n)) == sizeof p.req) {
    // The answer is sent blocking, each message within kVmmTimeout.
    (void)::fcntl(p.fd.get(), F_SETFL, ::fcntl(p.fd.get(), F_GETFL) & ~O_NONBLOCK);
    SetTimeouts(p.fd.get());
    Answer(p.fd.get(), p.req.magic, p.req.id);
    return true;
  }
  return false;
}

void VmmServer::AcceptOne(Pending* pending, size_t* count, absl::Time now) {
  net::Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!fd.valid()) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      ::usleep(10000);  // out of descriptors: later
    }
    return;
  }
  ucred peer{};
  socklen_t peer_len = sizeof peer;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 ||
      peer.uid != ::geteuid()) {
    // Root included: a root server shares with root's processes only.
    SetTimeouts(fd.get());
    Refuse(fd.get(), absl::StatusCode::kPermissionDenied,
           "VMM memory is shared with the same user only");
    return;
  }
  if (*count == kMaxVmmPending) {  // the oldest goes
    std::move(pending + 1, pending + *count, pending);
    --*count;
  }
  pending[(*count)++] = Pending{std::move(fd), Request{}, 0, now + kVmmRequestTime};
}

void VmmServer::Answer(int fd, uint64_t magic, uint64_t id) {
  Reply reply{};
  auto refuse = [&](absl::StatusCode code, const std::string& why) { Refuse(fd, code, why); };
  if (magic != kMagic) return refuse(absl::StatusCode::kInvalidArgument, "not a VMM request");
  Export e{};
  {
    MutexLock lock(&mu_);
    auto it = exports_.find(id);
    if (it == exports_.end()) {
      return refuse(absl::StatusCode::kNotFound, "no such VMM export (unregistered?)");
    }
    e = it->second;
  }
  absl::StatusOr<cuda::Driver::VmmExport> x =
      cuda::Driver::Get()->ExportVmm(e.addr, e.length, e.ordinal);
  if (!x.ok()) return refuse(x.status().code(), std::string(x.status().message()));
  std::vector<int> fds;
  std::vector<uint64_t> sizes;
  for (const cuda::Driver::VmmChunk& c : x->chunks) {
    fds.push_back(c.fd);
    sizes.push_back(c.size);
  }
  if (fds.size() > kMaxVmmChunks) {
    CloseAll(fds);
    return refuse(absl::StatusCode::kResourceExhausted, "too many VMM chunks");
  }
  reply.count = static_cast<uint32_t>(fds.size());
  reply.offset = x->offset;
  reply.length = e.length;
  absl::Status sent = SendMsg(fd, &reply, sizeof reply, nullptr, 0);
  if (sent.ok()) sent = SendMsg(fd, sizes.data(), sizes.size() * sizeof(uint64_t), nullptr, 0);
  for (size_t i = 0; sent.ok() && i < fds.size(); i += kFdsPerMessage) {
    const size_t k = std::min(kFdsPerMessage, fds.size() - i);
    const uint32_t n = static_cast<uint32_t>(k);
    sent = SendMsg(fd, &n, sizeof n, fds.data() + i, k);
  }
  CloseAll(fds);  // the receiver has its own copies
}

namespace {

// A VMM server's reply on `fd`: the header, the chunks' sizes, then their
// descriptors (into `fds`, which the caller closes, also on error).
absl::Status ReceiveReply(int fd, Reply* reply, std::vector<uint64_t>* sizes,
                          std::vector<int>* fds) {
  RETURN_IF_ERROR(RecvMsg(fd, reply, sizeof *reply, fds, 0));
  if (reply->code != 0) {
    reply->text[sizeof reply->text - 1] = '\0';
    return absl::UnavailableError(absl::StrCat("the peer's VMM server refused: ", reply->text));
  }
  if (reply->count == 0 || reply->count > kMaxVmmChunks) {
    return absl::DataLossError(absl::StrCat("a VMM reply of ", reply->count, " chunks"));
  }
  sizes->resize(reply->count);
  RETURN_IF_ERROR(RecvMsg(fd, sizes->data(), sizes->size() * sizeof(uint64_t), fds, 0));
  // Each receive waits at most kVmmTimeout; the whole reply, at most 5 of
  // them (a server that trickles it out is given up on).
  const absl::Time deadline = absl::Now() + 5 * kVmmTimeout;
  while (fds->size() < reply->count) {
    uint32_t n = 0;
    RETURN_IF_ERROR(RecvMsg(fd, &n, sizeof n, fds, reply->count));
    if (fds->size() < reply->count && absl::Now() > deadline) {
      return absl::DeadlineExceededError("the VMM server's reply took too long");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadVmmReply(int fd, std::vector<uint64_t>* sizes, std::vector<int>* fds) {
  Reply reply;
  return ReceiveReply(fd, &reply, sizes, fds);
}

absl::StatusOr<net::Fd> ConnectVmmServer(uint64_t name) {
  net::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  SetTimeouts(fd.get());
  socklen_t len;
  const sockaddr_un a = Address(name, &len);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), len) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach the peer's VMM server (another network namespace?): ", std::strerror(errno)));
  }
  return fd;
}

absl::StatusOr<VmmMapping> FetchVmm(uint64_t name, uint64_t id, int ordinal) {
  const cuda::Driver* driver = cuda::Driver::Get();
  if (driver == nullptr) return absl::UnavailableError("no CUDA driver");
  ASSIGN_OR_RETURN(net::Fd fd, ConnectVmmServer(name));
  const Request req{kMagic, id};
  RETURN_IF_ERROR(SendMsg(fd.get(), &req, sizeof req, nullptr, 0));
  Reply reply{};
  std::vector<int> fds;
  std::vector<uint64_t> sizes;
  absl::Status got = ReceiveReply(fd.get(), &reply, &sizes, &fds);
  absl::StatusOr<void*> base = absl::UnavailableError("not mapped");
  uint64_t total = 0;
  if (got.ok()) {
    std::vector<cuda::Driver::VmmChunk> chunks;
    bool sane = true;
    for (size_t i = 0; i < sizes.size(); ++i) {
      chunks.push_back(cuda::Driver::VmmChunk{fds[i], sizes[i]});
      sane = sane && sizes[i] > 0 && total + sizes[i] > total;
      total += sizes[i];
    }
    if (!sane || reply.offset > total || reply.length > total - reply.offset) {
      got = absl::DataLossError("a VMM reply with empty chunks or a region outside them");
    } else {
      base = driver->ImportVmm(chunks, ordinal);
      if (!base.ok()) got = absl::UnavailableError(base.status().message());
    }
  }
  CloseAll(fds);  // the mappings hold the memory
  RETURN_IF_ERROR(got);
  VmmMapping m;
  m.base = *base;
  m.total = total;
  m.start = static_cast<char*>(*base) + reply.offset;
  m.length = reply.length;
  m.ordinal = ordinal;
  return m;
}

void UnmapVmm(const VmmMapping& m) {
  if (m.base != nullptr) cuda::Driver::Get()->VmmUnmap(m.base, m.total, m.ordinal);
}

}  // namespace transport
}  // namespace kvferry
