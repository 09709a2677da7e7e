#include "tools/gpu/two_process.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "handshake/tcp_network.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace kvferry {
namespace gpu {

std::unique_ptr<TransferEngine> LoopbackEngine(bool cuda_ipc, uint32_t links,
                                               uint64_t slice_bytes) {
  transport::TcpTransportOptions t;
  t.bind_host = "127.0.0.1";
  t.in_process_shortcut = false;
  auto tcp = transport::CreateTcpTransport(t);
  if (!tcp.ok()) return nullptr;
  EngineParts parts;
  parts.transport = std::move(*tcp);
  if (cuda_ipc) {
    // Beside TCP, as Create makes it where a CUDA driver loads: the path
    // choice sends the peer on this host over it.
    transport::CudaIpcTransportOptions ipc;
    ipc.stream = t;
    auto same_host = transport::CreateCudaIpcTransport(ipc);
    if (!same_host.ok()) return nullptr;
    parts.same_host = std::move(*same_host);
  }
  parts.network = handshake::NewTcpNetwork();
  parts.detection.host = "127.0.0.1";
  parts.detection.transport = "tcp";
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.links_per_peer = links;
  o.slice_bytes = slice_bytes;
  auto e = TransferEngine::CreateWith(o, std::move(parts));
  return e.ok() ? std::move(*e) : nullptr;
}

uint64_t Fnv(const std::vector<char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line;
}

void WriteLine(int fd, const std::string& line) {
  const std::string text = line + "\n";
  if (write(fd, text.data(), text.size()) < 0) std::perror("write");
}

}  // namespace gpu
}  // namespace kvferry
