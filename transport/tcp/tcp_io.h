// The TCP transport's socket I/O: sending iovecs (whole, or what the socket
// takes now), reading a link's stream, and the pinned staging buffers
// through which device memory crosses a socket. Internal to
// transport/tcp (see tcp_transport_internal.h).
#ifndef KVFERRY_TRANSPORT_TCP_TCP_IO_H_
#define KVFERRY_TRANSPORT_TCP_TCP_IO_H_

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "transport/tcp/stream_reader.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

// Reads from a link's stream (its reader thread only).
absl::Status ReadStream(StreamReader& in, void* dst, size_t n);

// Sends the iovecs; `wait` false: only what the socket takes now (*sent
// says how much). Under the sanitizers the bytes are copied first, so the
// reads of request buffers happen here, where the race detector sees them.
absl::Status SendIov(int fd, iovec* iov, int count, bool wait, size_t* sent);

absl::Status SendAll(int fd, iovec* iov, int count);

// Pinned host buffers through which a link sends or receives device
// memory, the CPU never touching it: two of 256 KiB, so that the driver
// copies one chunk while the socket carries the other (copies queued on a
// stream of the device). Made on first use; one per direction per link, so
// nothing is allocated per request.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    const cuda::Driver* d = cuda::Driver::Get();
    if (d == nullptr) return;
    for (size_t i = 0; i < streams_.size(); ++i) d->DestroyStream(streams_[i], static_cast<int>(i));
    d->GivePinned(buffer_, 2 * kBytes);  // kept for the next link: no cuMemFreeHost here
  }
  // Sends [src, +n) of CUDA device `device` on `fd`: chunk k+1 is copied
  // to one buffer while chunk k is sent from the other.
  absl::Status Send(int fd, const void* src, uint64_t n, int device) {
    ASSIGN_OR_RETURN(void* stream, Ready(device));
    const cuda::Driver* d = cuda::Driver::Get();
    const char* from = static_cast<const char*>(src);
    RETURN_IF_ERROR(d->CopyAsync(Half(0), from, std::min<uint64_t>(kBytes, n), stream, device));
    RETURN_IF_ERROR(d->Synchronize(stream, device));
    int cur = 0;
    for (uint64_t off = 0; off < n;) {
      const size_t len = std::min<uint64_t>(kBytes, n - off);
      const uint64_t next = off + len;
      if (next < n) {
        RETURN_IF_ERROR(d->CopyAsync(Half(1 - cur), from + next,
                                     std::min<uint64_t>(kBytes, n - next), stream, device));
      }
      iovec v{Half(cur), len};
      const absl::Status sent = SendAll(fd, &v, 1);
      const absl::Status copied = next < n ? d->Synchronize(stream, device) : absl::OkStatus();
      RETURN_IF_ERROR(sent);
      RETURN_IF_ERROR(copied);
      off = next;
      cur = 1 - cur;
    }
    return absl::OkStatus();
  }
  // Receives n bytes from `in` into [dst, +n) of CUDA device `device`:
  // chunk k+1 arrives in one buffer while chunk k is copied from the other.
  absl::Status Recv(StreamReader& in, void* dst, uint64_t n, int device) {
    ASSIGN_OR_RETURN(void* stream, Ready(device));
    const cuda::Driver* d = cuda::Driver::Get();
    char* to = static_cast<char*>(dst);
    int cur = 0;
    bool pending = false;  // a copy out of the other buffer is running
    absl::Status status;
    for (uint64_t off = 0; off < n && status.ok();) {
      const size_t len = std::min<uint64_t>(kBytes, n - off);
      status = ReadStream(in, Half(cur), len);
      if (pending) {
        const absl::Status copied = d->Synchronize(stream, device);
        if (status.ok()) status = copied;
        pending = false;
      }
      if (!status.ok()) break;
      status = d->CopyAsync(to + off, Half(cur), len, stream, device);
      pending = status.ok();
      off += len;
      cur = 1 - cur;
    }
    if (pending) {
      const absl::Status copied = d->Synchronize(stream, device);
      if (status.ok()) status = copied;
    }
    return status;
  }

 private:
  static constexpr size_t kBytes = 256 << 10;
  char* Half(int i) const { return static_cast<char*>(buffer_) + i * kBytes; }
  // The buffers, and the stream of `device`.
  absl::StatusOr<void*> Ready(int device) {
    const cuda::Driver* driver = cuda::Driver::Get();
    if (driver == nullptr)
      return absl::FailedPreconditionError("device memory without a CUDA driver");
    if (buffer_ == nullptr) {
      ASSIGN_OR_RETURN(buffer_, driver->TakePinned(2 * kBytes));
    }
    if (device < 0) return absl::InvalidArgumentError("staging host memory");
    if (static_cast<size_t>(device) >= streams_.size()) streams_.resize(device + 1, nullptr);
    if (streams_[device] == nullptr) {
      ASSIGN_OR_RETURN(streams_[device], driver->CreateStream(device));
    }
    return streams_[device];
  }
  void* buffer_ = nullptr;
  std::vector<void*> streams_;  // by device ordinal
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_TCP_IO_H_
