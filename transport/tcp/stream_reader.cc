#include "transport/tcp/stream_reader.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "base/errno_status.h"
#include "base/status_macros.h"

namespace kvferry {
namespace transport {
namespace {

absl::Status RecvError(ssize_t r, int err) {
  if (r == 0) return absl::UnavailableError("peer closed the connection");
  return absl::UnavailableError(ErrnoError(err, "recv").message());
}

}  // namespace

absl::Status StreamReader::Fill(uint64_t wanted) {
  head_ = tail_ = 0;
  const size_t most = static_cast<size_t>(std::min<uint64_t>(wanted + ahead_, kCapacity));
  for (;;) {
    const ssize_t r = ::recv(fd_, buffer_.get(), most, 0);
    if (r > 0) {
      tail_ = static_cast<size_t>(r);
      return absl::OkStatus();
    }
    if (r < 0 && errno == EINTR) continue;
    return RecvError(r, errno);
  }
}

absl::StatusOr<size_t> StreamReader::TryFill() {
  if (head_ > 0) {
    std::memmove(buffer_.get(), buffer_.get() + head_, tail_ - head_);
    tail_ -= head_;
    head_ = 0;
  }
  if (tail_ == kCapacity) return 0;
  for (;;) {
    const ssize_t r = ::recv(fd_, buffer_.get() + tail_, kCapacity - tail_, MSG_DONTWAIT);
    if (r > 0) {
      tail_ += static_cast<size_t>(r);
      return static_cast<size_t>(r);
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return RecvError(r, errno);
  }
}

absl::Status StreamReader::Read(void* dst, size_t n) {
  char* p = static_cast<char*>(dst);
  // Decided on the whole read, not on what the buffer leaves of it: a
  // payload of kDirect bytes whose first bytes came with its header still
  // goes straight in (deciding on the rest copied such a payload through
  // the buffer whenever its header had read ahead into it).
  const bool direct = n >= kDirect;
  for (;;) {
    const size_t take = std::min(n, tail_ - head_);
    if (take > 0) {
      std::memcpy(p, buffer_.get() + head_, take);
      copied_ += take;
    }
    head_ += take;
    p += take;
    n -= take;
    if (n == 0) return absl::OkStatus();
    if (direct) break;  // the buffer is empty: the rest goes straight in
    RETURN_IF_ERROR(Fill(n));
  }
  if (ahead_ > 0 && n <= kCapacity) {
    // Whatever is there, up to the end of the read and `ahead_` bytes
    // behind it (the next header, say): one system call for both when the
    // stream is busy. (Not for larger reads: one that returns with part of
    // the payload costs a second call, and saves little on so many bytes.)
    iovec v[2] = {{p, n}, {buffer_.get(), std::min(ahead_, kCapacity)}};
    msghdr msg{};
    msg.msg_iov = v;
    msg.msg_iovlen = 2;
    ssize_t r;
    do {
      r = ::recvmsg(fd_, &msg, 0);
    } while (r < 0 && errno == EINTR);
    if (r <= 0) return RecvError(r, errno);
    head_ = 0;
    if (static_cast<size_t>(r) >= n) {
      tail_ = static_cast<size_t>(r) - n;
      return absl::OkStatus();
    }
    tail_ = 0;
    p += r;
    n -= static_cast<size_t>(r);
  }
  while (n > 0) {
    const ssize_t r = ::recv(fd_, p, n, MSG_WAITALL);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0 || errno != EINTR) {
      return RecvError(r, errno);
    }
  }
  return absl::OkStatus();
}

absl::Status StreamReader::Skip(uint64_t n) {
  while (n > 0) {
    if (head_ == tail_) RETURN_IF_ERROR(Fill(n));
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, tail_ - head_));
    head_ += take;
    n -= take;
  }
  return absl::OkStatus();
}

}  // namespace transport
}  // namespace kvferry
