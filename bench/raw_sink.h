// The raw TCP reference the benchmarks measure the engine against: a sink
// that reads batches of blocks into a buffer and answers each batch with
// one byte, or echoes a block back; and the client calls that drive it.
// No framing beyond a 32-byte header, no threads beyond one per connection:
// what a program that only moves bytes over a socket would do.
#ifndef KVFERRY_BENCH_RAW_SINK_H_
#define KVFERRY_BENCH_RAW_SINK_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "net/socket.h"

namespace kvferry {
namespace bench {

// Serves connections into [buffer, buffer + length) until the process
// ends: its threads are detached, so it is never destroyed. A thread per
// open connection, started ahead and reused: one thread accepts while the
// others wait for the turn, and a connection costs a hand-over, not a
// thread creation.
class RawSink {
 public:
  static absl::StatusOr<RawSink*> Start(const std::string& host, char* buffer, uint64_t length);
  std::string address() const { return listener_.address.ToString(); }

 private:
  RawSink(char* buffer, uint64_t length) : buffer_(buffer), length_(length) {}
  // For ever: waits to be the acceptor (starting another thread when no
  // other is waiting for the turn), accepts one connection, hands the turn
  // on and serves the connection.
  void Turn();
  void Serve(int fd);
  char* const buffer_;
  const uint64_t length_;
  net::ListeningSocket listener_;
  Mutex mu_;
  CondVar turn_free_;
  bool accepting_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for the turn
};

// Connects to a sink (TCP_NODELAY on).
absl::StatusOr<net::Fd> RawConnect(const std::string& sink);
// Sends `count` blocks of `block` bytes as one batch, block i from
// `src + i * stride`, that the sink writes at `offset + i * stride` of its
// buffer (modulo its size): senders on several connections at once give
// each its own range. `stride` 0 (or `block`): blocks that follow each
// other; larger: scattered blocks (a KV cache's pages). The header and the
// blocks go in one gather (net::WriteFullV).
absl::Status RawSend(int fd, const char* src, uint32_t count, uint64_t block, uint64_t offset = 0,
                     uint64_t stride = 0);
// Waits for the sink's answer to a batch.
absl::Status RawAwaitAck(int fd, absl::Time deadline);
// Sends `block` bytes from `src` and reads them back into `dst`.
absl::Status RawEcho(int fd, const char* src, char* dst, uint64_t block);

}  // namespace bench
}  // namespace kvferry

#endif  // KVFERRY_BENCH_RAW_SINK_H_
