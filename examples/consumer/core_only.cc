// A program built against @kvferry//engine:core alone: the engine without
// its RDMA and TCP transports, for users that bring their own transport.
// Assembling one from no parts must fail with a clear error, not crash.
#include <cstdio>

#include "engine/transfer_engine.h"

int main() {
  kvferry::EngineOptions options;
  auto engine = kvferry::TransferEngine::CreateWith(options, kvferry::EngineParts{});
  if (engine.ok()) {
    std::fprintf(stderr, "CreateWith without a transport succeeded\n");
    return 1;
  }
  std::printf("core: CreateWith without parts refused: %s\n", engine.status().ToString().c_str());
  return 0;
}
