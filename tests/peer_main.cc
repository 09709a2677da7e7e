// A peer engine in its own process, for tests that kill, freeze and restart
// peers (peer_failure_test, soak_test):
//   peer_main --port=P [--bytes=N] [--secret_env]
// Serves a zeroed buffer of N bytes over TCP on 127.0.0.1:P (P=0: any free
// port), publishes "buffer" = "<address> <length>" as metadata, prints
// "READY <host:port>" and waits to be killed. Raises its
// descriptor limit to the hard limit (attack tests open many connections).
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "engine/transfer_engine.h"

ABSL_FLAG(uint16_t, port, 0, "handshake port (0: any free one)");
ABSL_FLAG(uint64_t, bytes, 1 << 20, "bytes of registered memory");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }
  kvferry::EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  o.port = absl::GetFlag(FLAGS_port);
  auto engine = kvferry::TransferEngine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "peer_main: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<char> buffer(absl::GetFlag(FLAGS_bytes), 0);
  // Tests write into it and read it back.
  absl::Status st = (*engine)->RegisterMemory(buffer.data(), buffer.size(),
                                              kvferry::transport::Access::kRemoteReadWrite);
  if (st.ok()) {
    st = (*engine)->PublishMetadata(
        "buffer", absl::StrCat(reinterpret_cast<uintptr_t>(buffer.data()), " ", buffer.size()));
  }
  if (!st.ok()) {
    std::fprintf(stderr, "peer_main: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("READY %s\n", (*engine)->address().c_str());
  std::fflush(stdout);
  for (;;) pause();
}
