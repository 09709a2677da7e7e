#include "engine/metrics/metrics_server.h"

#include <sys/socket.h>

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"

namespace kvferry {

namespace {
constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxHead = 8192;
constexpr absl::Duration kRequestTime = absl::Seconds(2);
}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& host, uint16_t port, std::function<std::string()> render) {
  absl::StatusOr<net::ListeningSocket> s = net::Listen(host, port, net::PortRange{0, 0});
  if (!s.ok()) return s.status();
  std::string address = s->address.ToString();
  std::unique_ptr<MetricsServer> server(
      new MetricsServer(std::move(*s), std::move(address), std::move(render)));
  absl::StatusOr<std::unique_ptr<net::EventLoop>> loop = net::EventLoop::Start("metrics");
  if (!loop.ok()) return loop.status();
  server->loop_ = std::move(*loop);
  MetricsServer* m = server.get();
  absl::Status watched;
  m->loop_->Run([&] {
    watched = net::ServeListener(
        m->loop_.get(), m->socket_.fd.get(), [m](net::Fd fd) { m->Admit(std::move(fd)); },
        [](int) {});
    m->sweep_timer_ = m->loop_->After(kRequestTime, [m] { m->Sweep(); });
  });
  if (!watched.ok()) return watched;
  return server;
}

MetricsServer::MetricsServer(net::ListeningSocket socket, std::string address,
                             std::function<std::string()> render)
    : socket_(std::move(socket)), address_(std::move(address)), render_(std::move(render)) {}

MetricsServer::~MetricsServer() {
  if (loop_ == nullptr) return;
  loop_->Run([this] {
    loop_->Cancel(sweep_timer_);
    loop_->Unwatch(socket_.fd.get());
    while (!conns_.empty()) Close(conns_.begin()->first);
  });
  loop_.reset();
}

void MetricsServer::Admit(net::Fd fd) {
  if (conns_.size() >= kMaxConnections) {
    int oldest = -1;
    absl::Time when = absl::InfiniteFuture();
    for (const auto& [f, c] : conns_) {
      if (c.opened < when) {
        when = c.opened;
        oldest = f;
      }
    }
    Close(oldest);
  }
  const int raw = fd.get();
  if (!loop_->Watch(raw, EPOLLIN | EPOLLRDHUP, [this, raw](uint32_t e) { OnEvent(raw, e); }).ok()) {
    return;
  }
  Conn& c = conns_[raw];
  c.fd = std::move(fd);
  c.opened = absl::Now();
}

void MetricsServer::OnEvent(int fd, uint32_t events) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  Conn& c = it->second;
  if (c.out.empty()) {
    char buf[1024];
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0 || c.in.size() + n > kMaxHead) {
      Close(fd);
      return;
    }
    c.in.append(buf, n);
    if (c.in.find("\r\n\r\n") == std::string::npos) return;
    Answer(c);
  }
  (void)events;
  while (c.sent < c.out.size()) {
    const ssize_t n =
        ::send(fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      (void)loop_->Modify(fd, EPOLLOUT);
      return;
    }
    if (n <= 0) break;
    c.sent += n;
  }
  Close(fd);
}

void MetricsServer::Answer(Conn& c) {
  std::string status = "200 OK", body;
  if (absl::StartsWith(c.in, "GET /metrics ") || absl::StartsWith(c.in, "GET /metrics?")) {
    body = render_();
  } else {
    status = "404 Not Found";
    body = "kvferry serves only GET /metrics\n";
  }
  c.out = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n",
                       "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

void MetricsServer::Close(int fd) {
  loop_->Unwatch(fd);
  conns_.erase(fd);
}

void MetricsServer::Sweep() {
  const absl::Time now = absl::Now();
  std::vector<int> slow;
  for (const auto& [fd, c] : conns_) {
    if (now - c.opened > kRequestTime) slow.push_back(fd);
  }
  for (int fd : slow) Close(fd);
  sweep_timer_ = loop_->After(absl::Milliseconds(500), [this] { Sweep(); });
}

}  // namespace kvferry
