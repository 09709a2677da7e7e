// The receiving side of a link's TCP stream, for its reader thread alone.
// Small messages (headers, small payloads) come out of one buffer that a
// single recv fills with as much as the socket holds, so a stream of 4 KiB
// WRITEs costs one system call per buffer rather than two per request;
// payloads of kDirect bytes or more go straight from the socket into their
// destination, with (in the same system call, when it is there) what
// follows them up to ReadAhead bytes. Blocking (but TryFill); shutdown()
// of the socket unblocks it. One thread at a time: the link's reader, or
// a waiter it handed its turn to (the link's `park`).
#ifndef KVFERRY_TRANSPORT_TCP_STREAM_READER_H_
#define KVFERRY_TRANSPORT_TCP_STREAM_READER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvferry {
namespace transport {

class StreamReader {
 public:
  static constexpr size_t kCapacity = 64 << 10;
  static constexpr size_t kDirect = 16 << 10;

  explicit StreamReader(int fd) : fd_(fd), buffer_(new char[kCapacity]) {}
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;

  // Exactly n bytes into [dst, +n). kUnavailable when the peer closed the
  // connection or recv failed.
  absl::Status Read(void* dst, size_t n);
  // Reads and drops n bytes.
  absl::Status Skip(uint64_t n);
  // How many bytes a read from the socket may take beyond what the caller
  // asked for, when they are there already (kCapacity, the default: as
  // much as the buffer holds). While the messages carry large payloads the
  // caller keeps this to a header: bytes read ahead of a payload are copied
  // out of the buffer again.
  void ReadAhead(size_t bytes) { ahead_ = bytes; }
  // Bytes received and not yet read out.
  size_t Buffered() const { return tail_ - head_; }
  // Without blocking: one recv of whatever the socket holds, behind what
  // is buffered (moved to the front of the buffer first). Returns the bytes
  // taken, 0 when there were none; kUnavailable as Read.
  absl::StatusOr<size_t> TryFill();
  // The buffered bytes (Buffered() of them), and dropping the first n of
  // them (n <= Buffered()).
  const char* Peek() const { return buffer_.get() + head_; }
  void Drop(size_t n) { head_ += n; }
  // Bytes Read has copied out of the buffer so far (for tests: a direct
  // payload is not among them).
  uint64_t Copied() const { return copied_; }

 private:
  // One recv into the (empty) buffer: up to `wanted` bytes and ahead_
  // more, at most kCapacity.
  absl::Status Fill(uint64_t wanted);

  const int fd_;
  const std::unique_ptr<char[]> buffer_;
  size_t head_ = 0;  // [head_, tail_): received, not read out
  size_t tail_ = 0;
  size_t ahead_ = kCapacity;
  uint64_t copied_ = 0;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_STREAM_READER_H_
