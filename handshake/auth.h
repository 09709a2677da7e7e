// An optional pre-shared secret for the handshake: a Network decorator that
// authenticates every request and every reply with HMAC-SHA256 and encrypts
// their payloads with AES-256-GCM (OpenSSL's libcrypto), so an engine gives
// no descriptor, no keys, no link and takes no notification from anyone who
// does not hold the secret, and no one on the wire reads what they carry.
//
// Each call is a challenge-response:
//   client -> kChallenge                      server -> kChallengeReply{nonce_s}
//   client -> kAuthenticated{nonce_s, nonce_c, type, sealed,
//             HMAC(secret, "kvferry-req" nonce_s nonce_c type sealed)}
//   server -> kAuthenticatedReply{nonce_s, nonce_c, type, sealed,
//             HMAC(secret, "kvferry-rep" nonce_s nonce_c type sealed)}
// where `sealed` is the payload under AES-256-GCM with the key
// HMAC(secret, "kvferry-enc-req"/"kvferry-enc-rep" nonce_s nonce_c): a key
// for each message, derived from the secret and the exchange's nonces.
// A server nonce is good once and for `challenge_ttl`. The server keeps no
// state per challenge (a nonce carries its expiry and a MAC of it under the
// secret), so a flood of challenges cannot evict a client's nonce; it
// remembers only nonces used by authenticated requests, until they expire,
// to refuse replays. A request without a valid tag, or any plain request,
// is refused (kUnauthenticated), counted and logged (rate limited;
// peer-visible facts only, never the secret). The client checks
// the reply's tag too, so a peer without the secret cannot feed it a
// descriptor. A client with a secret never falls back to a plain call.
#ifndef KVFERRY_HANDSHAKE_AUTH_H_
#define KVFERRY_HANDSHAKE_AUTH_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "base/clock.h"
#include "base/hmac.h"
#include "handshake/network.h"

namespace kvferry {
namespace handshake {

struct AuthOptions {
  std::string secret;  // required, at least 16 bytes
  absl::Duration challenge_ttl = absl::Seconds(30);
  Clock* clock = nullptr;  // null: the real clock
  // Source of nonces; empty: OpenSSL's RAND_bytes.
  std::function<std::string(size_t bytes)> random;
};

// The environment variable engines read the secret from.
inline constexpr char kSecretEnv[] = "KVFERRY_SECRET";

// How a service without a secret answers an authentication request
// (kChallenge, kAuthenticated): refused, never downgraded, so that a peer
// with a secret does not talk to it without one. nullopt for any other
// request.
std::optional<Frame> RefuseWithoutSecret(const Frame& request);

class AuthenticatedNetwork : public Network {
 public:
  // kInvalidArgument for a secret shorter than 16 bytes.
  static absl::StatusOr<std::unique_ptr<AuthenticatedNetwork>> Create(
      std::unique_ptr<Network> inner, AuthOptions options);
  ~AuthenticatedNetwork() override;

  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions& options,
                                                Handler handler) override;
  absl::StatusOr<Frame> Call(const std::string& peer, const Frame& request,
                             absl::Duration timeout) override;

  // Requests refused so far (plain, bad tag, unknown or reused nonce).
  uint64_t rejected() const;

 private:
  struct State;
  AuthenticatedNetwork(std::unique_ptr<Network> inner, std::shared_ptr<State> state);
  std::unique_ptr<Network> inner_;
  std::shared_ptr<State> state_;
};

// HMAC-SHA256 of `data` under `key` (32 bytes; base/hmac.h).
using ::kvferry::HmacSha256;

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_AUTH_H_
