// The TCP data port's front door, on an event loop: accepts connections,
// reads each one's 16-byte hello (magic, link token) without blocking on
// any of them, and keeps the connections that said hello until the
// handshake's AcceptLink claims them by token. Bounded throughout:
//   - at most `max_pending` connections, hello'd or not; at the cap the
//     oldest is closed to admit a new one;
//   - a hello must arrive within `hello_timeout`, and an unclaimed
//     connection is closed after `claim_timeout` (by a timer, whether or
//     not anything else arrives);
//   - a second connection with a token already waiting is refused, and the
//     first is kept;
//   - at the descriptor limit the listener pauses instead of spinning.
//   - at most `max_pending` claims wait for their connection (ClaimOrAwait),
//     each until its deadline.
// Refusals are counted and logged at most once a second.
#ifndef KVFERRY_TRANSPORT_TCP_HELLO_ACCEPTOR_H_
#define KVFERRY_TRANSPORT_TCP_HELLO_ACCEPTOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "net/socket.h"

namespace kvferry {
namespace transport {

inline constexpr uint64_t kHelloMagic = 0x32305043'5446564bULL;  // "KVFTCP02"
inline constexpr size_t kHelloBytes = 16;
// With a secret: magic, token, then HMAC-SHA256(secret, "kvferry-data-hello"
// token): only a holder of the secret can open a data connection for the
// token an authenticated handshake carries.
inline constexpr uint64_t kAuthHelloMagic = 0x33305043'5446564bULL;  // "KVFTCP03"
inline constexpr size_t kAuthHelloBytes = 48;

// The hello a link's connection opens with: plain without a secret.
std::string EncodeHello(uint64_t token, const std::string& secret);

// What the first bytes of a data connection say, for an engine with
// `secret` (empty: none). `token` is known once 16 bytes are in.
struct HelloVerdict {
  enum Kind {
    kIncomplete,  // more bytes needed
    kAccept,      // a hello of the right kind (and, with a secret, tag)
    kWrongKind,   // authenticated where this end has no secret, or plain where it has one
    kBadMagic,    // not a hello
    kBadTag,      // does not prove the secret
  };
  Kind kind = kIncomplete;
  uint64_t token = 0;
};
HelloVerdict CheckHello(absl::string_view bytes, const std::string& secret);

struct HelloAcceptorOptions {
  // Non-empty: only authenticated hellos (kAuthHelloMagic, a valid tag) are
  // accepted; empty: only plain ones.
  std::string secret;
  size_t max_pending = 256;
  absl::Duration hello_timeout = absl::Seconds(2);
  absl::Duration claim_timeout = absl::Seconds(30);
  // A claim made before its connection arrived waits at most this long
  // (the requester connects before it asks for the link, or as soon as the
  // peer's descriptor is in when both travel in one round trip: one round
  // trip and a connect, with a lost SYN sent again after 1 s, is well
  // within it), and at `max_pending` claims the oldest is failed to make
  // room: claims with made-up tokens neither last long nor lock other
  // peers out.
  absl::Duration claim_wait = absl::Seconds(2);
};

struct HelloAcceptorStats {
  uint64_t accepted = 0;
  uint64_t pending = 0;     // connections held now
  uint64_t bad_hellos = 0;  // wrong magic, closed, or too slow
  uint64_t duplicate_tokens = 0;
  uint64_t evicted = 0;         // at the cap
  uint64_t expired = 0;         // never claimed
  uint64_t unclaimed = 0;       // connections whose hello is in, not yet claimed
  uint64_t claims = 0;          // claims waiting for their connection now
  uint64_t claims_expired = 0;  // claims whose connection never came
  uint64_t claims_evicted = 0;  // claims failed at the cap to make room
  uint64_t accept_pauses = 0;
};

class HelloAcceptor {
 public:
  // Serves `listener` (made non-blocking here) on a loop of its own.
  static absl::StatusOr<std::unique_ptr<HelloAcceptor>> Start(int listener,
                                                              HelloAcceptorOptions options);
  ~HelloAcceptor();
  // The connection whose hello carried `token` (in blocking mode), waiting
  // for it until `deadline`. kUnavailable when none arrives.
  absl::StatusOr<net::Fd> Claim(uint64_t token, absl::Time deadline);
  // Claims without waiting: the connection when its hello is in (and
  // `deliver` is never called), else an invalid Fd, and `deliver` gets the
  // connection on the acceptor's thread when its hello arrives (or on the
  // thread that calls Deliver), or
  // kUnavailable if none does by `deadline`. `deliver` is never called once
  // the acceptor is destroyed. kResourceExhausted when `max_pending` claims
  // wait already.
  using Delivery = std::function<void(absl::StatusOr<net::Fd>)>;
  absl::StatusOr<net::Fd> ClaimOrAwait(uint64_t token, absl::Time deadline, Delivery deliver);
  // A connection for `token` that came another way (the handshake's own,
  // kConnectLinksHere), in blocking mode: to the claim that waits for it,
  // on this thread. kNotFound, and `conn` closed, when no claim waits.
  absl::Status Deliver(uint64_t token, net::Fd conn);
  HelloAcceptorStats stats() const;

 private:
  struct State;
  explicit HelloAcceptor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_HELLO_ACCEPTOR_H_
