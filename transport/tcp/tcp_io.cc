#include "transport/tcp/tcp_io.h"

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <string>

#include "base/errno_status.h"
#include "net/socket.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {
namespace {

// The sanitizers' sendmsg interceptor checks the sent bytes after the call
// returns, when a peer in the same process may already have completed the
// request and freed the buffer; and ThreadSanitizer cannot see that bytes
// handed to send() in one thread are what recv() returns in another. Under
// ASan/TSan only, data is therefore copied to a private buffer before
// sending, and (TSan) a release after every send / acquire after every
// receive records the ordering the kernel provides.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVFERRY_SANITIZED_IO 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVFERRY_SANITIZED_IO 1
#endif
#if defined(KVFERRY_SANITIZED_IO)
constexpr bool kCopyBeforeSend = true;
#else
constexpr bool kCopyBeforeSend = false;
#endif
#if defined(__SANITIZE_THREAD__)
std::atomic<uint64_t> wire_epoch{0};
void AfterSend() { wire_epoch.fetch_add(1, std::memory_order_release); }
void AfterRecv() { (void)wire_epoch.load(std::memory_order_acquire); }
#else
void AfterSend() {}
void AfterRecv() {}
#endif

}  // namespace

absl::Status ReadStream(StreamReader& in, void* dst, size_t n) {
  absl::Status s = in.Read(dst, n);
  AfterRecv();
  return s;
}

absl::Status SendIov(int fd, iovec* iov, int count, bool wait, size_t* sent) {
  std::string copy;
  iovec flat;
  if (kCopyBeforeSend) {
    for (int i = 0; i < count; ++i) {
      copy.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
    }
    flat = {copy.data(), copy.size()};
    iov = &flat;
    count = 1;
  }
  *sent = 0;
  const int flags = MSG_NOSIGNAL | (wait ? 0 : MSG_DONTWAIT);
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t w = ::sendmsg(fd, &msg, flags);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return absl::UnavailableError(ErrnoError(errno, "send").message());
    }
    *sent += static_cast<size_t>(w);
    net::SkipBytes(iov, count, static_cast<size_t>(w));
  }
  AfterSend();
  return absl::OkStatus();
}

absl::Status SendAll(int fd, iovec* iov, int count) {
  size_t sent;
  return SendIov(fd, iov, count, /*wait=*/true, &sent);
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
