// A minimal HTTP endpoint for Prometheus scrapers: GET /metrics answers
// with whatever `render` returns (text format 0.0.4), anything else 404.
// One thread; each connection gets one answer and is closed.
#ifndef KVFERRY_ENGINE_METRICS_SERVER_H_
#define KVFERRY_ENGINE_METRICS_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
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
  MetricsServer(net::ListeningSocket socket, std::string address,
                std::function<std::string()> render);
  void Loop();
  void Answer(int fd);

  net::ListeningSocket socket_;
  const std::string address_;
  const std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_METRICS_SERVER_H_
