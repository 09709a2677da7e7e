#include "handshake/tcp_network.h"

#include <sys/socket.h>

#include <atomic>
#include <list>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "handshake/tcp_server.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {

namespace {

absl::StatusOr<Frame> ReadFrame(int fd, uint32_t max_bytes, absl::Time deadline) {
  char header[kFrameHeaderBytes];
  RETURN_IF_ERROR(net::ReadFull(fd, header, sizeof header, deadline));
  ASSIGN_OR_RETURN(FrameHeader h,
                   ParseFrameHeader(absl::string_view(header, sizeof header), max_bytes));
  Frame f;
  f.type = h.type;
  // Grow as the bytes arrive, never to a length the peer merely claimed.
  constexpr size_t kChunk = 256 << 10;
  while (f.payload.size() < h.payload_bytes) {
    const size_t have = f.payload.size();
    const size_t n = std::min<size_t>(kChunk, h.payload_bytes - have);
    f.payload.resize(have + n);
    RETURN_IF_ERROR(net::ReadFull(fd, f.payload.data() + have, n, deadline));
  }
  return f;
}

class TcpNetwork final : public Network, public HandOver {
 public:
  explicit TcpNetwork(TcpNetworkOptions options) : options_(options) {}

  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions& o, Handler handler) override {
    return ServeHandingOver(o, std::move(handler));
  }

  absl::StatusOr<std::unique_ptr<Server>> ServeHandingOver(const ServeOptions& o,
                                                           HandingHandler handler) override {
    ASSIGN_OR_RETURN(net::ListeningSocket socket,
                     net::Listen(o.bind_host, o.port, {o.first_port, o.last_port}));
    std::string host = o.advertise_host.empty() ? o.bind_host : o.advertise_host;
    std::string address = net::HostPort{host, socket.address.port()}.ToString();
    TcpServerOptions server_options = options_.server;
    server_options.may_block = o.may_block;
    ASSIGN_OR_RETURN(std::unique_ptr<TcpServer> server,
                     TcpServer::Start(std::move(socket), std::move(address), std::move(handler),
                                      std::move(server_options)));
    return std::unique_ptr<Server>(std::move(server));
  }

  absl::StatusOr<Frame> Call(const std::string& peer, const Frame& request,
                             absl::Duration timeout) override {
    absl::StatusOr<Frame> answer = absl::UnavailableError("no reply");
    CallPipelined(peer, {request}, timeout, [&](size_t, absl::StatusOr<Frame> reply) {
      answer = std::move(reply);
      return true;
    });
    return answer;
  }

  void CallPipelined(const std::string& peer, const std::vector<Frame>& requests,
                     absl::Duration timeout, const ReplyFn& on_reply) override {
    CallThenTake(peer, requests, timeout, on_reply, nullptr);
  }

  void* QueryExtension(absl::string_view name) override {
    return name == HandOver::kName ? static_cast<HandOver*>(this) : nullptr;
  }

  void CallThenTake(const std::string& peer, const std::vector<Frame>& requests,
                    absl::Duration timeout, const ReplyFn& on_reply, const TakeFn& take) override {
    if (requests.empty()) return;
    const absl::Time deadline = absl::Now() + timeout;
    absl::StatusOr<net::HostPort> hp = net::ParseHostPort(peer);
    if (!hp.ok()) {
      on_reply(0, hp.status());
      return;
    }
    std::string bytes;
    for (const Frame& f : requests) bytes += EncodeFrame(f.type, f.payload);
    // An idle pooled connection may have been closed by the peer meanwhile;
    // such a failure before the first reply is retried once on a fresh
    // connection (the other idle ones are dropped too: a restarted peer
    // closed them all).
    for (int attempt = 0; attempt < 2; ++attempt) {
      net::Fd fd = TakeIdle(peer);
      const bool pooled = fd.valid();
      if (!pooled) {
        absl::StatusOr<net::Fd> fresh = net::Connect(*hp, deadline - absl::Now());
        if (!fresh.ok()) {
          absl::Status failed = absl::UnavailableError(
              absl::StrCat("handshake with ", peer, " failed: ", fresh.status().message()));
          on_reply(0, net::ConnectionRefused(fresh.status()) ? net::MarkRefused(failed) : failed);
          return;
        }
        fd = std::move(*fresh);
        (void)net::SetNoDelay(fd.get());
      }
      const absl::Status sent = net::WriteFull(fd.get(), bytes.data(), bytes.size(), deadline);
      // A connection the reply may hand over: another one is started while
      // the peer answers, for the calls that follow (a notification after
      // the first transfer), and pooled either way.
      net::Fd spare;
      if (take != nullptr && sent.ok()) {
        absl::StatusOr<net::Fd> started = net::ConnectStart(*hp);
        if (started.ok()) spare = std::move(*started);
      }
      bool retry = false;
      for (size_t i = 0; i < requests.size() && !retry; ++i) {
        absl::StatusOr<Frame> reply = sent.ok()
                                          ? ReadFrame(fd.get(), options_.max_frame_bytes, deadline)
                                          : absl::StatusOr<Frame>(sent);
        if (!reply.ok()) {
          retry = i == 0 && pooled && reply.status().code() == absl::StatusCode::kUnavailable;
          if (retry) {
            DropIdle(peer);
            continue;
          }
          on_reply(i, Failed(peer, requests[i].type, reply.status(), timeout));
          return;
        }
        const bool more = on_reply(i, reply->type == MessageType::kError
                                          ? absl::StatusOr<Frame>(DecodeError(reply->payload))
                                          : std::move(reply));
        if (!more && i + 1 < requests.size()) return;  // the rest unread: not reused
      }
      if (retry) continue;
      if (take == nullptr || !take(fd)) PutIdle(peer, std::move(fd));
      if (spare.valid()) PutIdle(peer, std::move(spare));
      return;
    }
    on_reply(0, absl::UnavailableError(absl::StrCat("handshake with ", peer, " failed")));
  }

 private:
  // A failed exchange's error, naming the peer.
  static absl::Status Failed(const std::string& peer, MessageType type, const absl::Status& s,
                             absl::Duration timeout) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      return absl::DeadlineExceededError(absl::StrCat("handshake with ", peer, ": no reply to ",
                                                      MessageTypeName(type), " within ",
                                                      absl::FormatDuration(timeout)));
    }
    return absl::Status(s.code(), absl::StrCat("handshake with ", peer, ": ", s.message()));
  }

  net::Fd TakeIdle(const std::string& peer) {
    MutexLock lock(&mu_);
    auto it = idle_.find(peer);
    if (it == idle_.end() || it->second.empty()) return net::Fd();
    net::Fd fd = std::move(it->second.back());
    it->second.pop_back();
    return fd;
  }
  void DropIdle(const std::string& peer) {
    std::vector<net::Fd> stale;  // closed outside the lock
    MutexLock lock(&mu_);
    auto it = idle_.find(peer);
    if (it != idle_.end()) stale.swap(it->second);
  }
  void PutIdle(const std::string& peer, net::Fd fd) {
    MutexLock lock(&mu_);
    auto& list = idle_[peer];
    if (list.size() < 4) list.push_back(std::move(fd));
  }

  const TcpNetworkOptions options_;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::vector<net::Fd>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<Network> NewTcpNetwork(TcpNetworkOptions options) {
  return std::make_unique<TcpNetwork>(options);
}

}  // namespace handshake
}  // namespace kvferry
