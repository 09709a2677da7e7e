// Engines on this host for tests: loopback addresses, and a port an engine
// can be restarted on.
#ifndef KVFERRY_ENGINE_TESTING_LOCAL_ENGINES_H_
#define KVFERRY_ENGINE_TESTING_LOCAL_ENGINES_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <memory>

#include "engine/transfer_engine.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace testing_local {

// Options of an engine that advertises 127.0.0.1.
inline EngineOptions Local() {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  return o;
}

// The engine, or null (the test has failed then).
inline std::unique_ptr<TransferEngine> MakeEngine(EngineOptions o = Local()) {
  auto e = TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// A free port from the kernel's ephemeral range, which lies outside the
// engines' [first_port, last_port]: no engine of another test process
// (tests run in parallel) takes it once this test lets it go. 0 on error.
inline uint16_t EphemeralPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  const bool picked = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0;
  if (fd >= 0) ::close(fd);
  EXPECT_TRUE(picked);
  return picked ? ntohs(sa.sin_port) : 0;
}

}  // namespace testing_local
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_TESTING_LOCAL_ENGINES_H_
