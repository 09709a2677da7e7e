// A minimal HTTP endpoint for Prometheus scrapers: GET /metrics answers
// with whatever `render` returns (text format 0.0.4), anything else 404.
// Connections are served concurrently on one event loop: each sends one
// request head (at most 8 KiB, within 2 s) and gets one answer, then is
// closed. At most 64 connections are open; at the cap the oldest is closed.
#ifndef KVFERRY_ENGINE_METRICS_METRICS_SERVER_H_
#define KVFERRY_ENGINE_METRICS_METRICS_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "net/event_loop.h"
#include "net/socket.h"

namespace kvferry {

class MetricsServer {
 public:
  // Listens on host:port (port 0: any free one).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host,
                                                              uint16_t port,
                                                              std::function<std::string()> render);
  ~MetricsServer();
  // "host:port" to scrape.
  const std::string& address() const { return address_; }

 private:
  struct Conn {
    net::Fd fd;
    std::string in, out;
    size_t sent = 0;
    absl::Time opened;
  };
  MetricsServer(net::ListeningSocket socket, std::string address,
                std::function<std::string()> render);
  void Admit(net::Fd fd);
  void OnEvent(int fd, uint32_t events);
  void Answer(Conn& c);
  void Close(int fd);
  void Sweep();

  net::ListeningSocket socket_;
  const std::string address_;
  const std::function<std::string()> render_;
  std::unique_ptr<net::EventLoop> loop_;
  absl::flat_hash_map<int, Conn> conns_;  // loop thread only
  uint64_t sweep_timer_ = 0;
};

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_METRICS_METRICS_SERVER_H_
