// The handshake service over TCP, on one event loop: every connection is a
// small state machine (bytes in, one request at a time to a fixed pool of
// handler threads, the reply out), so no peer can make the engine spawn a
// thread, and what a peer can make it hold is bounded:
//   - at most `max_connections` connections: at the cap, the connection
//     that has been quiet longest is closed to admit a new one;
//   - a request's buffer grows as its bytes arrive, never from the length a
//     header claims, and all partial requests and unsent replies together
//     stay under `max_buffered_bytes`. Over it, the connection holding the
//     most buffered bytes is closed, not the one that read last;
//   - a header may claim only what its type can need
//     (MaxRequestPayloadBytes): a describe, probe or challenge is never
//     large. Requests claiming over 64 KiB (notifications, or authenticated
//     frames around them) are "large": together they may hold all of the
//     budget but `small_headroom`, so small requests always fit, and at most
//     `max_large_per_source` of them are in progress from one address;
//   - a request must arrive whole within `request_timeout` of its first
//     byte, and a reply be taken within it; a silent connection is closed
//     after `idle_timeout`;
//   - at the process's file-descriptor limit the listener pauses (no
//     spinning) and resumes when descriptors free up.
// Refused input is counted, and logged at most once a second.
#ifndef KVFERRY_HANDSHAKE_TCP_SERVER_H_
#define KVFERRY_HANDSHAKE_TCP_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "handshake/hand_over.h"
#include "handshake/network.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {

struct TcpServerOptions {
  // The largest request accepted: a notification (kMaxNotifyBytes) with
  // the authentication envelope around it.
  uint32_t max_request_bytes = kMaxNotifyBytes + (64 << 10);
  size_t max_connections = 1024;
  size_t max_buffered_bytes = 32 << 20;
  // The part of max_buffered_bytes that large requests may not take; 0: a
  // quarter of it.
  size_t small_headroom = 0;
  // Large requests in progress at once from one source address; more are
  // refused (kResourceExhausted) at their header.
  size_t max_large_per_source = 8;
  absl::Duration request_timeout = absl::Seconds(5);
  absl::Duration idle_timeout = absl::Seconds(60);
  // Threads that run the handler for requests that may wait (e.g. for a
  // data connection to arrive).
  int handler_threads = 2;
  // Which requests those are (ServeOptions::may_block); the others are
  // answered on the loop thread. Empty: all of them.
  std::function<bool(const Frame& request)> may_block;
};

// Counters a server keeps (for tests and metrics).
struct TcpServerStats {
  uint64_t accepted = 0;
  uint64_t open = 0;
  uint64_t evicted = 0;         // closed at the connection cap
  uint64_t refused_frames = 0;  // malformed or oversized
  uint64_t reaped = 0;          // idle or too slow
  uint64_t shed = 0;            // over the buffer budget, or its source's share of large requests
  uint64_t accept_pauses = 0;   // at the file-descriptor limit
  uint64_t handed_over = 0;     // to another owner (Answer::take)
};

class TcpServer : public Server {
 public:
  // `handler` answers each request, and may hand its connection over
  // (hand_over.h).
  static absl::StatusOr<std::unique_ptr<TcpServer>> Start(net::ListeningSocket socket,
                                                          std::string address,
                                                          HandingHandler handler,
                                                          TcpServerOptions options);
  ~TcpServer() override;
  std::string address() const override;
  TcpServerStats stats() const;
  std::vector<std::pair<std::string, uint64_t>> RefusedInput() const override;

 private:
  struct State;
  explicit TcpServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_TCP_SERVER_H_
