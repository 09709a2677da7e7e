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
#include "net/socket.h"

namespace kvferry {
namespace handshake {

namespace {

absl::Status WriteFrame(int fd, const Frame& f, absl::Time deadline) {
  const std::string bytes = EncodeFrame(f.type, f.payload);
  return net::WriteFull(fd, bytes.data(), bytes.size(), deadline);
}

absl::StatusOr<Frame> ReadFrame(int fd, uint32_t max_bytes, absl::Time deadline) {
  char header[kFrameHeaderBytes];
  RETURN_IF_ERROR(net::ReadFull(fd, header, sizeof header, deadline));
  ASSIGN_OR_RETURN(FrameHeader h,
                   ParseFrameHeader(absl::string_view(header, sizeof header), max_bytes));
  Frame f;
  f.type = h.type;
  f.payload.resize(h.payload_bytes);
  RETURN_IF_ERROR(net::ReadFull(fd, f.payload.data(), f.payload.size(), deadline));
  return f;
}

class TcpServer final : public Server {
 public:
  TcpServer(net::ListeningSocket socket, std::string address, Handler handler,
            TcpNetworkOptions options)
      : socket_(std::move(socket)),
        address_(std::move(address)),
        handler_(std::move(handler)),
        options_(options) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~TcpServer() override {
    stopping_ = true;
    ::shutdown(socket_.fd.get(), SHUT_RDWR);
    accept_thread_.join();
    std::list<Connection> connections;
    {
      MutexLock lock(&mu_);
      for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
      connections.swap(connections_);
    }
    for (auto& c : connections) c.thread.join();
  }

  std::string address() const override { return address_; }

 private:
  void AcceptLoop() {
    while (!stopping_) {
      auto fd = net::Accept(socket_.fd.get(), absl::Seconds(1));
      if (stopping_) return;
      if (!fd.ok()) continue;
      MutexLock lock(&mu_);
      // Join the threads of connections that have ended.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (it->done->load()) {
          it->thread.join();
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
      open_fds_.push_back(fd->get());
      auto done = std::make_shared<std::atomic<bool>>(false);
      auto conn = std::make_shared<net::Fd>(std::move(*fd));
      connections_.push_back(Connection{std::thread([this, conn, done] {
                                          Serve(conn->get());
                                          MutexLock l(&mu_);
                                          open_fds_.erase(std::find(open_fds_.begin(),
                                                                    open_fds_.end(),
                                                                    conn->get()));
                                          done->store(true);
                                        }),
                                        done});
    }
  }

  void Serve(int fd) {
    (void)net::SetNoDelay(fd);
    while (!stopping_) {
      absl::StatusOr<Frame> request =
          ReadFrame(fd, options_.max_frame_bytes, absl::Now() + options_.idle_timeout);
      if (!request.ok()) {
        // A peer closing an idle connection is normal; anything else is
        // worth a line in the log.
        if (request.status().code() != absl::StatusCode::kUnavailable &&
            request.status().code() != absl::StatusCode::kDeadlineExceeded) {
          KVF_LOG(WARNING) << "handshake " << address_
                           << ": closing a connection: " << request.status();
          // Tell the peer why, best effort.
          (void)WriteFrame(fd, ErrorFrame(request.status()),
                           absl::Now() + absl::Milliseconds(100));
        }
        return;
      }
      Frame reply = handler_(*request);
      if (!WriteFrame(fd, reply, absl::Now() + absl::Seconds(10)).ok()) return;
    }
  }

  net::ListeningSocket socket_;
  const std::string address_;
  const Handler handler_;
  const TcpNetworkOptions options_;
  std::atomic<bool> stopping_{false};
  std::thread accept_thread_;
  Mutex mu_;
  struct Connection {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<int> open_fds_ ABSL_GUARDED_BY(mu_);
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

class TcpNetwork final : public Network {
 public:
  explicit TcpNetwork(TcpNetworkOptions options) : options_(options) {}

  absl::StatusOr<std::unique_ptr<Server>> Serve(const ServeOptions& o,
                                                Handler handler) override {
    ASSIGN_OR_RETURN(net::ListeningSocket socket,
                     net::Listen(o.bind_host, o.port, {o.first_port, o.last_port}));
    std::string host = o.advertise_host.empty() ? o.bind_host : o.advertise_host;
    std::string address = net::HostPort{host, socket.address.port()}.ToString();
    return std::unique_ptr<Server>(new TcpServer(std::move(socket), std::move(address),
                                                 std::move(handler), options_));
  }

  absl::StatusOr<Frame> Call(const std::string& peer, const Frame& request,
                             absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer));
    // An idle pooled connection may have been closed by the peer meanwhile;
    // such a failure is retried once on a fresh connection.
    for (int attempt = 0; attempt < 2; ++attempt) {
      net::Fd fd = TakeIdle(peer);
      const bool pooled = fd.valid();
      if (!pooled) {
        absl::StatusOr<net::Fd> fresh = net::Connect(hp, deadline - absl::Now());
        if (!fresh.ok()) {
          return absl::UnavailableError(absl::StrCat(
              "handshake with ", peer, " failed: ", fresh.status().message()));
        }
        fd = std::move(*fresh);
        (void)net::SetNoDelay(fd.get());
      }
      absl::Status sent = WriteFrame(fd.get(), request, deadline);
      absl::StatusOr<Frame> reply =
          sent.ok() ? ReadFrame(fd.get(), options_.max_frame_bytes, deadline)
                    : absl::StatusOr<Frame>(sent);
      if (!reply.ok()) {
        if (pooled && reply.status().code() == absl::StatusCode::kUnavailable) continue;
        if (reply.status().code() == absl::StatusCode::kDeadlineExceeded) {
          return absl::DeadlineExceededError(absl::StrCat(
              "handshake with ", peer, ": no reply to ", MessageTypeName(request.type),
              " within ", absl::FormatDuration(timeout)));
        }
        return absl::Status(reply.status().code(),
                            absl::StrCat("handshake with ", peer, ": ",
                                         reply.status().message()));
      }
      PutIdle(peer, std::move(fd));
      if (reply->type == MessageType::kError) return DecodeError(reply->payload);
      return reply;
    }
    return absl::UnavailableError(absl::StrCat("handshake with ", peer, " failed"));
  }

 private:
  net::Fd TakeIdle(const std::string& peer) {
    MutexLock lock(&mu_);
    auto it = idle_.find(peer);
    if (it == idle_.end() || it->second.empty()) return net::Fd();
    net::Fd fd = std::move(it->second.back());
    it->second.pop_back();
    return fd;
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
