#include "handshake/auth.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cstring>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/log_limiter.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "handshake/wire.h"

namespace kvferry {
namespace handshake {
namespace {

constexpr size_t kNonceBytes = 16;        // the client's
constexpr size_t kServerNonceBytes = 32;  // random(8) expiry(8) mac(16)
constexpr size_t kTagBytes = 32;

struct AuthenticatedFrame {
  std::string server_nonce, client_nonce;
  uint8_t type = 0;
  std::string payload, tag;
};

std::string Encode(const AuthenticatedFrame& f) {
  std::string out;
  Writer w(&out);
  w.Bytes(f.server_nonce);
  w.Bytes(f.client_nonce);
  w.U8(f.type);
  w.Bytes(f.payload);
  w.Bytes(f.tag);
  return out;
}

absl::StatusOr<AuthenticatedFrame> Decode(absl::string_view payload) {
  AuthenticatedFrame f;
  Reader r(payload);
  if (!r.Bytes(&f.server_nonce, kServerNonceBytes) || !r.Bytes(&f.client_nonce, kNonceBytes) ||
      !r.U8(&f.type) || !r.Bytes(&f.payload, kDefaultMaxFrameBytes) ||
      !r.Bytes(&f.tag, kTagBytes) || !r.AtEnd() || f.server_nonce.size() != kServerNonceBytes ||
      f.client_nonce.size() != kNonceBytes || f.tag.size() != kTagBytes || f.type == 0 ||
      f.type > kLastMessageType) {
    return absl::DataLossError("malformed authenticated frame");
  }
  return f;
}

// The type of the request inside an authenticated frame, read without
// copying its payload; 0 when malformed.
uint8_t InnerType(absl::string_view payload) {
  Reader r(payload);
  std::string server_nonce, client_nonce;
  uint8_t type = 0;
  if (!r.Bytes(&server_nonce, kServerNonceBytes) || !r.Bytes(&client_nonce, kNonceBytes) ||
      !r.U8(&type)) {
    return 0;
  }
  return type;
}

std::string Tag(absl::string_view secret, absl::string_view label, const AuthenticatedFrame& f) {
  std::string data;
  Writer w(&data);
  w.Bytes(label);
  w.Bytes(f.server_nonce);
  w.Bytes(f.client_nonce);
  w.U8(f.type);
  w.Bytes(f.payload);
  return HmacSha256(secret, data);
}

// The payloads are encrypted (AES-256-GCM) under a key of their own for
// each message: HMAC(secret, label, server nonce, client nonce), where the
// nonces are fresh for every exchange; so the IV can be fixed. The message
// type is authenticated data. Sealed: ciphertext, then the 16-byte GCM tag.
constexpr size_t kGcmTagBytes = 16;

std::string PayloadKey(absl::string_view secret, absl::string_view label,
                       const AuthenticatedFrame& f) {
  std::string data;
  Writer w(&data);
  w.Bytes(label);
  w.Bytes(f.server_nonce);
  w.Bytes(f.client_nonce);
  return HmacSha256(secret, data);
}

std::string Seal(absl::string_view key, uint8_t type, absl::string_view plain) {
  std::string out(plain.size() + kGcmTagBytes, '\0');
  const unsigned char iv[12] = {};
  auto* out_bytes = reinterpret_cast<unsigned char*>(out.data());
  int len = 0;
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  const bool ok =
      ctx != nullptr &&
      EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key.data()), iv) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &len, &type, 1) == 1 &&
      EVP_EncryptUpdate(ctx, out_bytes, &len, reinterpret_cast<const unsigned char*>(plain.data()),
                        static_cast<int>(plain.size())) == 1 &&
      EVP_EncryptFinal_ex(ctx, out_bytes + len, &len) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kGcmTagBytes, out_bytes + plain.size()) == 1;
  EVP_CIPHER_CTX_free(ctx);
  return ok ? out : std::string();
}

absl::StatusOr<std::string> Unseal(absl::string_view key, uint8_t type, absl::string_view sealed) {
  if (sealed.size() < kGcmTagBytes) return absl::DataLossError("sealed payload too short");
  const size_t n = sealed.size() - kGcmTagBytes;
  std::string out(n, '\0');
  const unsigned char iv[12] = {};
  int len = 0;
  unsigned char tag[kGcmTagBytes];
  std::memcpy(tag, sealed.data() + n, kGcmTagBytes);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  const bool ok =
      ctx != nullptr &&
      EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key.data()), iv) == 1 &&
      EVP_DecryptUpdate(ctx, nullptr, &len, &type, 1) == 1 &&
      EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                        reinterpret_cast<const unsigned char*>(sealed.data()),
                        static_cast<int>(n)) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kGcmTagBytes, tag) == 1 &&
      EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(out.data()) + len, &len) == 1;
  EVP_CIPHER_CTX_free(ctx);
  if (!ok) return absl::DataLossError("sealed payload does not open");
  return out;
}

std::string OpenSslRandom(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    return "";
  }
  return out;
}

}  // namespace

struct AuthenticatedNetwork::State {
  AuthOptions options;
  std::atomic<uint64_t> rejected{0};
  LogLimiter log_limit;
  Mutex mu;
  // Server nonces already used by an authenticated request, until they
  // expire (oldest first). Only holders of the secret add to it.
  absl::flat_hash_map<std::string, absl::Time> used ABSL_GUARDED_BY(mu);
  std::deque<std::pair<absl::Time, std::string>> used_order ABSL_GUARDED_BY(mu);

  absl::Time Now() const { return options.clock->Now(); }

  Frame Reject(const std::string& why) {
    const uint64_t n = ++rejected;
    uint64_t skipped;
    if (log_limit.Allow(&skipped)) {
      KVF_LOG(WARNING) << "handshake: refused an unauthenticated request (" << why << "); " << n
                       << " refused so far" << LogLimiter::Suffix(skipped);
    }
    return ErrorFrame(absl::UnauthenticatedError(
        "this engine requires an authenticated handshake: give both engines the same secret "
        "(EngineOptions::secret, KVFERRY_SECRET or KVFERRY_SECRET_FILE)"));
  }

  // A key of this network instance alone (random, made with it): its
  // nonces verify nowhere else, so a request authenticated for one engine
  // cannot be replayed to another with the same secret, or to this one
  // restarted.
  std::string instance_key;

  // random(8) expiry(8) and a MAC over both: the server keeps nothing per
  // challenge, so no flood of challenges can push out a client's nonce.
  std::string NonceMac(absl::string_view random_and_expiry) const {
    return HmacSha256(options.secret,
                      absl::StrCat("kvferry-nonce", instance_key, random_and_expiry))
        .substr(0, kServerNonceBytes - 16);
  }

  Frame Challenge() {
    std::string nonce = options.random(8);
    if (nonce.size() != 8)
      return ErrorFrame(absl::InternalError("no random bytes for a challenge"));
    Writer w(&nonce);
    w.U64(static_cast<uint64_t>(absl::ToUnixNanos(Now() + options.challenge_ttl)));
    nonce += NonceMac(nonce);
    return Frame{MessageType::kChallengeReply, nonce};
  }

  // True if this engine made `nonce`, it has not expired, and no
  // authenticated request used it before. Call only after the request's
  // tag checked out.
  bool Consume(const std::string& nonce) {
    if (nonce.size() != kServerNonceBytes) return false;
    const absl::string_view head(nonce.data(), 16);
    if (!SameTag(nonce.substr(16), NonceMac(head))) return false;
    uint64_t expiry_ns;
    Reader r(head.substr(8));
    if (!r.U64(&expiry_ns)) return false;
    const absl::Time expiry = absl::FromUnixNanos(static_cast<int64_t>(expiry_ns));
    const absl::Time now = Now();
    if (expiry <= now) return false;
    MutexLock lock(&mu);
    while (!used_order.empty() && used_order.front().first <= now) {
      used.erase(used_order.front().second);
      used_order.pop_front();
    }
    if (!used.emplace(nonce, expiry).second) return false;  // a replay
    used_order.emplace_back(expiry, nonce);
    return true;
  }

  Frame Serve(const Handler& handler, const Frame& request) {
    if (request.type == MessageType::kChallenge) return Challenge();
    if (request.type != MessageType::kAuthenticated) {
      return Reject(absl::StrCat("plain ", MessageTypeName(request.type)));
    }
    absl::StatusOr<AuthenticatedFrame> f = Decode(request.payload);
    if (!f.ok()) return Reject("malformed");
    if (!SameTag(f->tag, Tag(options.secret, "kvferry-req", *f))) return Reject("bad tag");
    if (!Consume(f->server_nonce)) return Reject("unknown, expired or reused challenge");
    absl::StatusOr<std::string> plain =
        Unseal(PayloadKey(options.secret, "kvferry-enc-req", *f), f->type, f->payload);
    if (!plain.ok()) return Reject("payload does not decrypt");
    const Frame reply = handler(Frame{static_cast<MessageType>(f->type), std::move(*plain)});
    AuthenticatedFrame out;
    out.server_nonce = std::move(f->server_nonce);
    out.client_nonce = std::move(f->client_nonce);
    out.type = static_cast<uint8_t>(reply.type);
    out.payload = Seal(PayloadKey(options.secret, "kvferry-enc-rep", out), out.type, reply.payload);
    out.tag = Tag(options.secret, "kvferry-rep", out);
    return Frame{MessageType::kAuthenticatedReply, Encode(out)};
  }
};

absl::StatusOr<std::unique_ptr<AuthenticatedNetwork>> AuthenticatedNetwork::Create(
    std::unique_ptr<Network> inner, AuthOptions options) {
  if (inner == nullptr) return absl::InvalidArgumentError("no network to authenticate");
  if (options.secret.size() < 16) {
    return absl::InvalidArgumentError(
        "the handshake secret must be at least 16 bytes (e.g. openssl rand -hex 32)");
  }
  if (options.clock == nullptr) options.clock = RealClock();
  if (!options.random) options.random = OpenSslRandom;
  auto state = std::make_shared<State>();
  state->instance_key = options.random(32);
  if (state->instance_key.size() != 32) {
    return absl::InternalError("no random bytes for the handshake's instance key");
  }
  state->options = std::move(options);
  return std::unique_ptr<AuthenticatedNetwork>(
      new AuthenticatedNetwork(std::move(inner), std::move(state)));
}

AuthenticatedNetwork::AuthenticatedNetwork(std::unique_ptr<Network> inner,
                                           std::shared_ptr<State> state)
    : inner_(std::move(inner)), state_(std::move(state)) {}
AuthenticatedNetwork::~AuthenticatedNetwork() = default;

uint64_t AuthenticatedNetwork::rejected() const { return state_->rejected.load(); }

absl::StatusOr<std::unique_ptr<Server>> AuthenticatedNetwork::Serve(const ServeOptions& options,
                                                                    Handler handler) {
  // Its connections carry wrapped frames, never a link: it offers no
  // hand-over (QueryExtension), whatever its inner network does.
  ServeOptions wrapped = options;
  if (options.may_block) {
    // Challenges and refusals never wait; an authenticated request waits as
    // the request inside it would (its type travels in clear).
    wrapped.may_block = [inner = options.may_block](const Frame& f) {
      if (f.type != MessageType::kAuthenticated) return false;
      const uint8_t type = InnerType(f.payload);
      return type != 0 && inner(Frame{static_cast<MessageType>(type), ""});
    };
  }
  // The state outlives this object if the server does.
  return inner_->Serve(wrapped, [state = state_, handler = std::move(handler)](const Frame& f) {
    return state->Serve(handler, f);
  });
}

absl::StatusOr<Frame> AuthenticatedNetwork::Call(const std::string& peer, const Frame& request,
                                                 absl::Duration timeout) {
  Clock* clock = state_->options.clock;
  const absl::Time deadline = clock->Now() + timeout;
  ASSIGN_OR_RETURN(Frame challenge,
                   inner_->Call(peer, Frame{MessageType::kChallenge, ""}, timeout));
  if (challenge.type != MessageType::kChallengeReply ||
      challenge.payload.size() != kServerNonceBytes) {
    return absl::UnauthenticatedError(absl::StrCat(
        "peer ", peer, " answered a challenge with ", MessageTypeName(challenge.type), " of ",
        challenge.payload.size(), " bytes: not an engine with the handshake secret"));
  }
  AuthenticatedFrame f;
  f.server_nonce = std::move(challenge.payload);
  f.client_nonce = state_->options.random(kNonceBytes);
  if (f.client_nonce.size() != kNonceBytes) return absl::InternalError("no random bytes");
  f.type = static_cast<uint8_t>(request.type);
  f.payload =
      Seal(PayloadKey(state_->options.secret, "kvferry-enc-req", f), f.type, request.payload);
  if (f.payload.empty()) return absl::InternalError("cannot encrypt a handshake request");
  f.tag = Tag(state_->options.secret, "kvferry-req", f);
  ASSIGN_OR_RETURN(Frame reply,
                   inner_->Call(peer, Frame{MessageType::kAuthenticated, Encode(f)},
                                std::max(deadline - clock->Now(), absl::Milliseconds(1))));
  absl::StatusOr<AuthenticatedFrame> got =
      reply.type == MessageType::kAuthenticatedReply
          ? Decode(reply.payload)
          : absl::StatusOr<AuthenticatedFrame>(absl::DataLossError("not authenticated"));
  if (!got.ok() || got->server_nonce != f.server_nonce || got->client_nonce != f.client_nonce ||
      !SameTag(got->tag, Tag(state_->options.secret, "kvferry-rep", *got))) {
    return absl::UnauthenticatedError(
        absl::StrCat("peer ", peer, " did not prove it holds the handshake secret; reply ignored"));
  }
  absl::StatusOr<std::string> plain =
      Unseal(PayloadKey(state_->options.secret, "kvferry-enc-rep", *got), got->type, got->payload);
  if (!plain.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat("peer ", peer, ": the reply does not decrypt; reply ignored"));
  }
  if (static_cast<MessageType>(got->type) == MessageType::kError) return DecodeError(*plain);
  return Frame{static_cast<MessageType>(got->type), std::move(*plain)};
}

std::optional<Frame> RefuseWithoutSecret(const Frame& request) {
  if (request.type != MessageType::kChallenge && request.type != MessageType::kAuthenticated) {
    return std::nullopt;
  }
  return ErrorFrame(absl::FailedPreconditionError(
      "this engine has no handshake secret, and its peers must not use one"));
}

}  // namespace handshake
}  // namespace kvferry
