#include "bench/raw_sink.h"

#include <sys/uio.h>

#include <memory>
#include <thread>
#include <vector>

#include "base/status_macros.h"

namespace kvferry {
namespace bench {
namespace {

struct Header {
  uint32_t kind = 0;   // kStream or kEcho
  uint32_t count = 0;  // kStream: blocks that follow
  uint64_t block = 0;
  uint64_t offset = 0;  // kStream: where in the sink's buffer the first block goes
  uint64_t stride = 0;  // kStream: from one block's start to the next's (0: block)
};
static_assert(sizeof(Header) == 32, "wire header size");

enum : uint32_t { kStream = 1, kEcho = 2 };

}  // namespace

absl::StatusOr<RawSink*> RawSink::Start(const std::string& host, char* buffer, uint64_t length) {
  auto s = std::unique_ptr<RawSink>(new RawSink(buffer, length));
  ASSIGN_OR_RETURN(s->listener_, net::Listen(host, 0, {0, 0}));
  RawSink* raw = s.release();
  std::thread([raw] { raw->Turn(); }).detach();
  return raw;
}

void RawSink::Turn() {
  for (;;) {
    bool spawn;
    {
      MutexLock lock(&mu_);
      ++waiting_;
      while (accepting_) turn_free_.Wait(&mu_);
      --waiting_;
      accepting_ = true;
      spawn = waiting_ == 0;  // nobody left to take the next turn
    }
    if (spawn) std::thread([this] { Turn(); }).detach();
    absl::StatusOr<net::Fd> fd;
    do {
      fd = net::Accept(listener_.fd.get(), absl::Hours(24));
    } while (!fd.ok());
    {
      MutexLock lock(&mu_);
      accepting_ = false;
    }
    turn_free_.Signal();  // a waiting thread accepts the next connection
    (void)net::SetNoDelay(fd->get());
    Serve(fd->get());
  }
}

void RawSink::Serve(int fd) {
  std::vector<char> echo;  // the connection's echo buffer, grown once
  Header h;
  while (net::ReadFull(fd, &h, sizeof h, absl::InfiniteFuture()).ok()) {
    if (h.block == 0 || h.block > length_ || h.stride > length_) return;
    if (h.kind == kStream) {
      const uint64_t stride = h.stride == 0 ? h.block : h.stride;
      for (uint32_t i = 0; i < h.count; ++i) {
        const uint64_t off = (h.offset + uint64_t(i) * stride) % (length_ - h.block + 1);
        if (!net::ReadFull(fd, buffer_ + off, h.block, absl::InfiniteFuture()).ok()) return;
      }
      const char ack = 1;
      if (!net::WriteFull(fd, &ack, 1, absl::InfiniteFuture()).ok()) return;
    } else if (h.kind == kEcho) {
      if (echo.size() < h.block) echo.resize(h.block);
      if (!net::ReadFull(fd, echo.data(), h.block, absl::InfiniteFuture()).ok() ||
          !net::WriteFull(fd, echo.data(), h.block, absl::InfiniteFuture()).ok()) {
        return;
      }
    } else {
      return;
    }
  }
}

absl::StatusOr<net::Fd> RawConnect(const std::string& sink) {
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(sink));
  ASSIGN_OR_RETURN(net::Fd fd, net::Connect(hp, absl::Seconds(5)));
  RETURN_IF_ERROR(net::SetNoDelay(fd.get()));
  return fd;
}

absl::Status RawSend(int fd, const char* src, uint32_t count, uint64_t block, uint64_t offset,
                     uint64_t stride) {
  if (stride == 0) stride = block;
  const Header h{kStream, count, block, offset, stride};
  // The header and every block in one gather, as a program sending pages
  // over a socket would.
  std::vector<iovec> iov;
  iov.reserve(count + 1);
  iov.push_back({const_cast<Header*>(&h), sizeof h});
  for (uint32_t i = 0; i < count; ++i) {
    iov.push_back({const_cast<char*>(src + uint64_t(i) * stride), block});
  }
  return net::WriteFullV(fd, iov.data(), iov.size(), absl::InfiniteFuture());
}

absl::Status RawAwaitAck(int fd, absl::Time deadline) {
  char ack;
  return net::ReadFull(fd, &ack, 1, deadline);
}

absl::Status RawEcho(int fd, const char* src, char* dst, uint64_t block) {
  const Header h{kEcho, 1, block, 0};
  RETURN_IF_ERROR(net::WriteFull(fd, &h, sizeof h, absl::InfiniteFuture()));
  RETURN_IF_ERROR(net::WriteFull(fd, src, block, absl::InfiniteFuture()));
  return net::ReadFull(fd, dst, block, absl::Now() + absl::Seconds(30));
}

}  // namespace bench
}  // namespace kvferry
