// The handshake server's state (tcp_server.cc: connections, dispatch, the
// handler pool; tcp_server_budget.cc: what partial requests may hold). For
// those two files only.
#ifndef KVFERRY_HANDSHAKE_TCP_SERVER_STATE_H_
#define KVFERRY_HANDSHAKE_TCP_SERVER_STATE_H_

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/log_limiter.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "handshake/tcp_server.h"
#include "net/event_loop.h"

namespace kvferry {
namespace handshake {

namespace server_internal {
constexpr size_t kReadChunk = 64 << 10;
// A request claiming more is large (a notification, or an authenticated
// frame around one): large ones share all but TcpServerOptions::
// small_headroom of the budget, at most max_large_per_source at a time.
constexpr uint32_t kSmallClaim = 64 << 10;
constexpr absl::Duration kSweepEvery = absl::Milliseconds(500);
}  // namespace server_internal

// Everything below runs on the loop thread, except the handler pool
// (Worker) and the atomics read by stats().
struct TcpServer::State {
  struct Conn {
    net::Fd fd;
    std::string in;   // bytes of requests not yet handed on
    std::string out;  // reply bytes not yet written
    size_t out_done = 0;
    bool busy = false;     // a request is with the handler
    bool closing = false;  // close once the reply is out
    TakeConnection take;   // hand the connection to it once the reply is out
    absl::Time last_active;
    absl::Time first_byte = absl::InfiniteFuture();  // of the partial request
    std::string source;                              // the peer's address, without the port
    // The request at the head of `in` claims more than kSmallClaim bytes:
    // its bytes count in `large_buffered`, and it in its source's count.
    bool large = false;
  };
  struct Job {
    uint64_t conn;
    Frame request;
    std::string source;  // RequestSource() while it is handled
  };

  net::ListeningSocket socket;
  std::string address;
  HandingHandler handler;
  TcpServerOptions options;
  std::unique_ptr<net::EventLoop> loop;

  // Loop thread only.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns;
  uint64_t last_conn = 0;
  size_t buffered = 0;
  size_t large_buffered = 0;  // the part of `buffered` in large partial requests
  absl::flat_hash_map<std::string, size_t> large_by_source;
  uint64_t sweep_timer = 0;

  // The handler pool.
  Mutex mu;
  CondVar cv;
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::vector<std::thread> workers;

  std::atomic<uint64_t> accepted{0}, evicted{0}, refused{0}, reaped{0}, pauses{0}, handed_over{0},
      shed{0};
  std::atomic<uint64_t> open{0};
  LogLimiter log_limit;

  void Admit(net::Fd fd);
  void EvictQuietest();
  void OnEvent(uint64_t id, uint32_t events);
  bool ReadSome(uint64_t id, Conn* c);
  absl::StatusOr<FrameHeader> Header(absl::string_view in) const;
  bool Classify(uint64_t id, Conn* c);
  void Unclassify(Conn* c);
  bool WithinBudget(uint64_t id, Conn* c);
  void Dispatch(uint64_t id, Conn* c);
  void OnReply(uint64_t id, Frame reply, TakeConnection take);
  bool Answer(uint64_t id, Conn* c, const Frame& reply, TakeConnection take, bool flush = true);
  bool SendReply(uint64_t id, Conn* c, const Frame& reply, bool flush = true);
  bool WholeRequestIn(const Conn& c) const;
  bool Flush(uint64_t id, Conn* c);
  void HandOver(uint64_t id, Conn* c);
  void Refuse(uint64_t id, Conn* c, const absl::Status& why);
  void Close(uint64_t id);
  void Sweep();
  void Worker();
  void Warn(const std::string& what) {
    uint64_t skipped;
    if (log_limit.Allow(&skipped)) {
      KVF_LOG(WARNING) << "handshake " << address << ": " << what << LogLimiter::Suffix(skipped);
    }
  }
};

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_TCP_SERVER_STATE_H_
