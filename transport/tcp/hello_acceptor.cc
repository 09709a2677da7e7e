#include "transport/tcp/hello_acceptor.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/hmac.h"
#include "base/log_limiter.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/recent_set.h"
#include "net/event_loop.h"

namespace kvferry {
namespace transport {

namespace {
constexpr absl::Duration kSweepEvery = absl::Milliseconds(250);

absl::Status RefusedError() {
  return absl::PermissionDeniedError(
      "the peer's data connection was refused: its hello does not match this end's secret "
      "(give every engine the same secret)");
}

std::string HelloTag(uint64_t token, const std::string& secret) {
  char bytes[8];
  std::memcpy(bytes, &token, 8);
  return HmacSha256(secret, absl::StrCat("kvferry-data-hello", absl::string_view(bytes, 8)));
}
}  // namespace

std::string EncodeHello(uint64_t token, const std::string& secret) {
  const uint64_t magic = secret.empty() ? kHelloMagic : kAuthHelloMagic;
  std::string hello(16, '\0');
  std::memcpy(&hello[0], &magic, 8);
  std::memcpy(&hello[8], &token, 8);
  if (!secret.empty()) hello += HelloTag(token, secret);
  return hello;
}

HelloVerdict CheckHello(absl::string_view bytes, const std::string& secret) {
  HelloVerdict v;
  if (bytes.size() < kHelloBytes) return v;
  uint64_t magic = 0;
  std::memcpy(&magic, bytes.data(), 8);
  std::memcpy(&v.token, bytes.data() + 8, 8);
  const uint64_t expected = secret.empty() ? kHelloMagic : kAuthHelloMagic;
  if (magic != expected) {
    v.kind = magic == kHelloMagic || magic == kAuthHelloMagic ? HelloVerdict::kWrongKind
                                                              : HelloVerdict::kBadMagic;
    return v;
  }
  if (bytes.size() < (secret.empty() ? kHelloBytes : kAuthHelloBytes)) return v;
  if (!secret.empty() && !SameTag(bytes.substr(kHelloBytes, 32), HelloTag(v.token, secret))) {
    v.kind = HelloVerdict::kBadTag;
    return v;
  }
  v.kind = HelloVerdict::kAccept;
  return v;
}

struct HelloAcceptor::State {
  // A connection that has not said hello yet (loop thread only).
  struct Arriving {
    net::Fd fd;
    char hello[kAuthHelloBytes];
    size_t got = 0;
    absl::Time arrived;
  };
  struct Waiting {
    net::Fd fd;
    absl::Time arrived;
  };
  // A claim made before its connection's hello arrived (ClaimOrAwait).
  struct Awaited {
    absl::Time deadline;
    Delivery deliver;
  };

  int listener = -1;
  HelloAcceptorOptions options;
  std::unique_ptr<net::EventLoop> loop;
  absl::flat_hash_map<int, Arriving> arriving;  // by fd; loop thread only
  uint64_t sweep_timer = 0;

  Mutex mu;
  CondVar cv;
  absl::flat_hash_map<uint64_t, Waiting> waiting ABSL_GUARDED_BY(mu);  // by token
  absl::flat_hash_map<uint64_t, Awaited> awaited ABSL_GUARDED_BY(mu);  // by token
  // Tokens of hellos refused for their magic or tag, so that a claim made
  // after the refusal fails at once (bounded: the latest max_pending).
  RecentSet<uint64_t> refused ABSL_GUARDED_BY(mu);
  explicit State(size_t max_refused) : refused(max_refused) {}
  // The claim waiting for `token`, taken out (empty when there is none).
  Delivery TakeClaimLocked(uint64_t token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto node = awaited.extract(token);
    return node ? std::move(node.mapped().deliver) : Delivery();
  }

  std::atomic<uint64_t> arriving_count{0};
  std::atomic<uint64_t> accepted{0}, bad{0}, duplicates{0}, evicted{0}, expired{0}, pauses{0},
      claims_expired{0}, claims_evicted{0};
  LogLimiter log_limit;

  void Warn(const std::string& what) {
    uint64_t skipped;
    if (log_limit.Allow(&skipped)) {
      KVF_LOG(WARNING) << "tcp transport: " << what << LogLimiter::Suffix(skipped);
    }
  }
  size_t Held() {
    MutexLock lock(&mu);
    return arriving.size() + waiting.size();
  }
  void Admit(net::Fd fd);
  void EvictOldest();
  void OnReadable(int fd);
  void Drop(int fd) {
    loop->Unwatch(fd);
    arriving_count -= arriving.erase(fd);
  }
  void Sweep();
  // A connection whose hello carried `token`: to the claim that waits for
  // it, else kept for one (a second one with a waiting token is closed).
  void HandOver(uint64_t token, net::Fd conn);
  // A hello that carried `token` was refused: its claim, made or to come,
  // fails.
  void Refuse(uint64_t token);
};

void HelloAcceptor::State::Refuse(uint64_t token) {
  Delivery deliver;
  {
    MutexLock lock(&mu);
    deliver = TakeClaimLocked(token);
    if (!deliver) {
      refused.Insert(token);
      return;
    }
  }
  deliver(RefusedError());
}

void HelloAcceptor::State::Admit(net::Fd fd) {
  ++accepted;
  if (Held() >= options.max_pending) EvictOldest();
  const int raw = fd.get();
  if (!loop->Watch(raw, EPOLLIN | EPOLLRDHUP, [this, raw](uint32_t) { OnReadable(raw); }).ok()) {
    return;
  }
  Arriving& a = arriving[raw];
  ++arriving_count;
  a.fd = std::move(fd);
  a.arrived = absl::Now();
}

void HelloAcceptor::State::EvictOldest() {
  ++evicted;
  Warn(absl::StrCat("at the cap of ", options.max_pending,
                    " pending data connections: closing the oldest"));
  int oldest_fd = -1;
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [fd, a] : arriving) {
    if (a.arrived < oldest) {
      oldest = a.arrived;
      oldest_fd = fd;
    }
  }
  if (oldest_fd >= 0) {
    Drop(oldest_fd);
    return;
  }
  MutexLock lock(&mu);
  auto victim = waiting.end();
  for (auto it = waiting.begin(); it != waiting.end(); ++it) {
    if (victim == waiting.end() || it->second.arrived < victim->second.arrived) victim = it;
  }
  if (victim != waiting.end()) waiting.erase(victim);
}

void HelloAcceptor::State::OnReadable(int fd) {
  auto it = arriving.find(fd);
  if (it == arriving.end()) return;
  Arriving& a = it->second;
  // The plain hello's 16 bytes first; an authenticated one has 32 more.
  const size_t want = options.secret.empty() ? kHelloBytes : kAuthHelloBytes;
  const ssize_t n = ::recv(fd, a.hello + a.got, want - a.got, 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    ++bad;
    Drop(fd);  // closed before its hello
    return;
  }
  a.got += n;
  const HelloVerdict v = CheckHello(absl::string_view(a.hello, a.got), options.secret);
  const uint64_t token = v.token;
  if (v.kind == HelloVerdict::kIncomplete) return;
  if (v.kind != HelloVerdict::kAccept) {
    ++bad;
    Warn(v.kind == HelloVerdict::kWrongKind
             ? "dropped a data connection: its hello is authenticated where this engine has no "
               "secret, or plain where it has one (give every engine the same secret)"
         : v.kind == HelloVerdict::kBadTag
             ? "dropped a data connection whose hello does not prove the secret"
             : "dropped a data connection without a valid hello");
    Refuse(token);  // first: a claim made once the peer sees the close fails
    Drop(fd);
    return;
  }
  // The connection leaves the loop: from now on its link's threads own it,
  // with blocking I/O.
  loop->Unwatch(fd);
  if (!net::SetBlocking(fd).ok()) {
    Drop(fd);
    return;
  }
  net::Fd conn = std::move(a.fd);
  arriving.erase(it);
  --arriving_count;
  HandOver(token, std::move(conn));
}

void HelloAcceptor::State::HandOver(uint64_t token, net::Fd conn) {
  Delivery deliver;
  {
    MutexLock lock(&mu);
    if (waiting.contains(token)) {
      ++duplicates;
      Warn("refused a data connection whose token is already waiting");
      return;  // closes `conn`; the first keeps its place
    }
    deliver = TakeClaimLocked(token);
    if (!deliver) {
      waiting.emplace(token, Waiting{std::move(conn), absl::Now()});
      cv.SignalAll();
      return;
    }
  }
  deliver(std::move(conn));  // outside the lock: it takes its owner's
}

void HelloAcceptor::State::Sweep() {
  const absl::Time now = absl::Now();
  std::vector<int> slow;
  for (const auto& [fd, a] : arriving) {
    if (now - a.arrived > options.hello_timeout) slow.push_back(fd);
  }
  for (int fd : slow) {
    ++bad;
    Drop(fd);
  }
  std::vector<Delivery> late;
  {
    MutexLock lock(&mu);
    for (auto it = waiting.begin(); it != waiting.end();) {
      auto stale = it++;
      // Never claimed: the peer gave up on the handshake, or never had one.
      if (now - stale->second.arrived > options.claim_timeout) {
        ++expired;
        waiting.erase(stale);
      }
    }
    for (auto it = awaited.begin(); it != awaited.end();) {
      auto stale = it++;
      if (now > stale->second.deadline) {
        ++claims_expired;
        late.push_back(std::move(stale->second.deliver));
        awaited.erase(stale);
      }
    }
  }
  for (Delivery& d : late) d(absl::UnavailableError("the peer's data connection never arrived"));
  sweep_timer = loop->After(kSweepEvery, [this] { Sweep(); });
}

HelloAcceptor::HelloAcceptor(std::unique_ptr<State> state) : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<HelloAcceptor>> HelloAcceptor::Start(int listener,
                                                                    HelloAcceptorOptions options) {
  auto s = std::make_unique<State>(options.max_pending);
  s->listener = listener;
  s->options = options;
  absl::StatusOr<std::unique_ptr<net::EventLoop>> loop = net::EventLoop::Start("tcp data port");
  if (!loop.ok()) return loop.status();
  s->loop = std::move(*loop);
  std::unique_ptr<HelloAcceptor> acceptor(new HelloAcceptor(std::move(s)));
  State* st = acceptor->state_.get();
  absl::Status watched;
  st->loop->Run([&] {
    watched = net::ServeListener(
        st->loop.get(), listener, [st](net::Fd fd) { st->Admit(std::move(fd)); },
        [st](int error) {
          ++st->pauses;
          st->Warn(absl::StrCat("cannot accept a data connection (", std::strerror(error),
                                "); pausing the listener"));
        });
    st->sweep_timer = st->loop->After(kSweepEvery, [st] { st->Sweep(); });
  });
  if (!watched.ok()) return watched;
  return acceptor;
}

HelloAcceptor::~HelloAcceptor() {
  State* st = state_.get();
  st->loop->Run([st] {
    st->loop->Cancel(st->sweep_timer);
    st->loop->Unwatch(st->listener);
    while (!st->arriving.empty()) st->Drop(st->arriving.begin()->first);
  });
  st->loop.reset();
  MutexLock lock(&st->mu);
  st->waiting.clear();
  st->awaited.clear();  // their owners are going away too: nothing delivered
}

absl::StatusOr<net::Fd> HelloAcceptor::Claim(uint64_t token, absl::Time deadline) {
  State* st = state_.get();
  MutexLock lock(&st->mu);
  if (!st->cv.AwaitWithDeadline(&st->mu, deadline, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return st->waiting.contains(token);
      })) {
    return absl::UnavailableError("the peer's data connection never arrived");
  }
  auto node = st->waiting.extract(token);
  return std::move(node.mapped().fd);
}

absl::StatusOr<net::Fd> HelloAcceptor::ClaimOrAwait(uint64_t token, absl::Time deadline,
                                                    Delivery deliver) {
  State* st = state_.get();
  Delivery evicted;
  {
    MutexLock lock(&st->mu);
    if (auto node = st->waiting.extract(token)) return std::move(node.mapped().fd);
    if (st->refused.Contains(token)) return RefusedError();
    if (st->awaited.contains(token)) {
      return absl::AlreadyExistsError("a link already waits for this connection");
    }
    if (st->awaited.size() >= st->options.max_pending) {
      // The oldest claim goes (its connection is the least likely to come).
      auto oldest = std::min_element(
          st->awaited.begin(), st->awaited.end(),
          [](const auto& a, const auto& b) { return a.second.deadline < b.second.deadline; });
      evicted = std::move(oldest->second.deliver);
      st->awaited.erase(oldest);
      ++st->claims_evicted;
    }
    deadline = std::min(deadline, absl::Now() + st->options.claim_wait);
    st->awaited.emplace(token, State::Awaited{deadline, std::move(deliver)});
  }
  if (evicted) {
    evicted(absl::ResourceExhaustedError(absl::StrCat(
        st->options.max_pending, " links waited for their data connections: the oldest went")));
  }
  return net::Fd();
}

absl::Status HelloAcceptor::Deliver(uint64_t token, net::Fd conn) {
  State* st = state_.get();
  Delivery deliver;
  {
    MutexLock lock(&st->mu);
    deliver = st->TakeClaimLocked(token);
  }
  if (!deliver) return absl::NotFoundError("no link waits for this connection");
  deliver(std::move(conn));
  return absl::OkStatus();
}

HelloAcceptorStats HelloAcceptor::stats() const {
  State* st = state_.get();
  HelloAcceptorStats s;
  s.accepted = st->accepted;
  s.bad_hellos = st->bad;
  s.duplicate_tokens = st->duplicates;
  s.evicted = st->evicted;
  s.expired = st->expired;
  s.claims_expired = st->claims_expired;
  s.claims_evicted = st->claims_evicted;
  s.accept_pauses = st->pauses;
  MutexLock lock(&st->mu);
  s.pending = st->waiting.size() + st->arriving_count;
  s.unclaimed = st->waiting.size();
  s.claims = st->awaited.size();
  return s;
}

}  // namespace transport
}  // namespace kvferry
