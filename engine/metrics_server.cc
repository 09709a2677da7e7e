#include "engine/metrics_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"

namespace kvferry {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& host, uint16_t port, std::function<std::string()> render) {
  absl::StatusOr<net::ListeningSocket> s = net::Listen(host, port, net::PortRange{0, 0});
  if (!s.ok()) return s.status();
  std::string address = s->address.ToString();
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(*s), std::move(address), std::move(render)));
}

MetricsServer::MetricsServer(net::ListeningSocket socket, std::string address,
                             std::function<std::string()> render)
    : socket_(std::move(socket)), address_(std::move(address)), render_(std::move(render)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  thread_.join();
}

void MetricsServer::Loop() {
  while (!stop_) {
    absl::StatusOr<net::Fd> c = net::Accept(socket_.fd.get(), absl::Milliseconds(100));
    if (c.ok()) Answer(c->get());
  }
}

void MetricsServer::Answer(int fd) {
  // Read the request head (bounded in size and time).
  std::string head;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (head.find("\r\n\r\n") == std::string::npos && head.size() < 8192) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (ms <= 0 || ::poll(&p, 1, static_cast<int>(ms)) <= 0) return;
    char buf[1024];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    head.append(buf, n);
  }
  std::string status = "200 OK", body;
  if (absl::StartsWith(head, "GET /metrics ") || absl::StartsWith(head, "GET /metrics?")) {
    body = render_();
  } else {
    status = "404 Not Found";
    body = "kvferry serves only GET /metrics\n";
  }
  const std::string reply =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n",
                   "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  if (absl::Status st = net::WriteFull(fd, reply.data(), reply.size(), absl::Now() + absl::Seconds(2));
      !st.ok()) {
    KVF_LOG(INFO) << "metrics: " << st.message();
  }
}

}  // namespace kvferry
