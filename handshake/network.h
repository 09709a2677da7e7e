// The network the handshake runs on: a request/reply service per engine and
// calls to other engines' services. Implemented over TCP (tcp_network.h) and
// over the simulated fabric (sim_network.h), so the same engine code
// handshakes in production and inside the deterministic simulator.
//
// LIFESPAN AND OWNERSHIP. A Network outlives every Server it started and
// every call in progress on it; the owner destroys the servers first. A
// Server stops serving when destroyed: once its destructor returns, its
// handler is not running and will not run again (so the handler may point
// at state destroyed right after the server). Pointers from
// QueryExtension live as long as the network.
//
// THREADS. Call, CallPipelined and Serve may be called from any number of
// threads at once; each Call blocks its caller up to its timeout, never
// longer. Over TCP a server owns an event loop thread and
// handler_threads handler threads (handlers run on either, see
// ServeOptions::may_block); in simulation handlers run in simulator
// events. A handler must not call Serve or destroy its own server.
#ifndef KVFERRY_HANDSHAKE_NETWORK_H_
#define KVFERRY_HANDSHAKE_NETWORK_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "handshake/messages.h"

namespace kvferry {
namespace handshake {

struct Frame {
  MessageType type = MessageType::kError;
  std::string payload;
};

// Answers one request. Runs on a server thread (TCP) or in a simulator
// event (sim); must not block for long.
using Handler = std::function<Frame(const Frame& request)>;

namespace network_internal {
inline thread_local absl::string_view request_source;
}  // namespace network_internal

// The address (the host, no port) that the request a handler answers on
// this thread came from, as the server's network saw it: a TCP peer's
// address, which a peer cannot choose as it can what its messages claim.
// Empty where the network does not know it (the simulated one) and outside
// a handler. For per-source shares of what peers may make an engine hold.
inline absl::string_view RequestSource() { return network_internal::request_source; }

// Sets RequestSource() for the handler called in its scope (servers).
class RequestSourceScope {
 public:
  explicit RequestSourceScope(absl::string_view source) : saved_(network_internal::request_source) {
    network_internal::request_source = source;
  }
  ~RequestSourceScope() { network_internal::request_source = saved_; }
  RequestSourceScope(const RequestSourceScope&) = delete;
  RequestSourceScope& operator=(const RequestSourceScope&) = delete;

 private:
  absl::string_view saved_;
};

// A running service; stops serving when destroyed.
class Server {
 public:
  virtual ~Server() = default;
  // "host:port" as peers should name it.
  virtual std::string address() const = 0;
  // Connections and requests refused or cut off so far, by reason (for
  // metrics). Empty where nothing is counted.
  virtual std::vector<std::pair<std::string, uint64_t>> RefusedInput() const { return {}; }
};

struct ServeOptions {
  std::string bind_host;       // IP to bind; "0.0.0.0"/"::" = all interfaces
  std::string advertise_host;  // what address() reports; empty: bind_host
  uint16_t port = 0;           // 0: first free port of the range
  uint16_t first_port = 15000;
  uint16_t last_port = 17000;
  // Which requests the handler may wait on (e.g. for a data connection to
  // arrive): those run on a handler thread. Others are answered where they
  // arrive (the server's event loop), which saves two thread hand-offs per
  // request; the handler must then return promptly. Empty: every request
  // may wait.
  std::function<bool(const Frame& request)> may_block;
};

class Network {
 public:
  virtual ~Network() = default;
  // Starts serving `handler`.
  virtual absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions& options,
                                                        Handler handler) = 0;
  // Sends `request` to the service at `peer` ("host:port") and returns its
  // reply (a kError reply is returned as its status). kUnavailable when the
  // peer cannot be reached, kDeadlineExceeded when it does not answer in
  // `timeout`.
  virtual absl::StatusOr<Frame> Call(const std::string& peer, const Frame& request,
                                     absl::Duration timeout) = 0;
  // Each request's reply (or its error, as Call returns it), handed to
  // `on_reply` in order; `on_reply` returns false to leave the rest
  // unanswered. A network that can sends them all on one connection before
  // reading the first reply, so that they cost one round trip and the
  // handling of a reply overlaps the next one's flight; after a broken
  // connection the rest get nothing. This default makes one Call after
  // another, `timeout` each.
  using ReplyFn = std::function<bool(size_t index, absl::StatusOr<Frame> reply)>;
  virtual void CallPipelined(const std::string& peer, const std::vector<Frame>& requests,
                             absl::Duration timeout, const ReplyFn& on_reply) {
    for (size_t i = 0; i < requests.size(); ++i) {
      if (!on_reply(i, Call(peer, requests[i], timeout))) return;
    }
  }
  // An extension interface this network also implements, by the name its
  // header gives it (HandOver::kName in handshake/hand_over.h); null when
  // it has none of that name (a decorator hides its inner network's). The
  // pointer lives as long as the network. Use ExtensionOf<E>() below.
  virtual void* QueryExtension(absl::string_view name) {
    (void)name;
    return nullptr;
  }
};

// `network`'s extension E (a class with a `kName`), or null.
template <typename E>
E* ExtensionOf(Network* network) {
  return static_cast<E*>(network->QueryExtension(E::kName));
}

// An error reply frame carrying `status`.
inline Frame ErrorFrame(const absl::Status& status) {
  return Frame{MessageType::kError, EncodeError(status)};
}

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_NETWORK_H_
