// A peer engine in its own process, for tests that kill, freeze and restart
// peers (peer_failure_test, soak_test):
//   peer_main --port=P [--bytes=N] [--secret_env]
// Serves a zeroed buffer of N bytes over TCP on 127.0.0.1:P (P=0: any free
// port), publishes "buffer" = "<address> <length>" as metadata, prints
// "READY <host:port>" and waits to be killed.
//   peer_main --kv_prefill_to=HOST:PORT --kv_request=ID [--kv_layer_delay_ms=D]
// Instead acts as a prefill: sends request ID of a KV pool of TestKvLayout()
// (every page to the same page, layer by layer, one every D ms, each byte
// `layer + 1`) to the decode at HOST:PORT, then finishes it, and waits to be
// killed (peer_failure_test kills or freezes it mid-request). With
// --kv_then=ID2, --kv_then_after_ms=T it then waits T ms and sends request
// ID2 of every layer at once (each byte `layer + 101`), and prints
// "FINISHED2 <status>". Raises its
// descriptor limit to the hard limit (attack tests open many connections).
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"
#include "tests/test_kv_layout.h"

ABSL_FLAG(uint16_t, port, 0, "handshake port (0: any free one)");
ABSL_FLAG(uint64_t, bytes, 1 << 20, "bytes of registered memory");
ABSL_FLAG(std::string, kv_prefill_to, "", "act as a prefill sending to this decode");
ABSL_FLAG(std::string, kv_request, "req", "the KV request id to send");
ABSL_FLAG(int, kv_layer_delay_ms, 300, "pause before each layer");
ABSL_FLAG(std::string, kv_then, "", "a second KV request id to send after the first");
ABSL_FLAG(int, kv_then_after_ms, 0, "pause before the second request");

namespace {

// Prefill mode (see the file comment); returns the exit code.
int Prefill(kvferry::TransferEngine* engine) {
  const kvferry::KvLayout layout = kvferry::TestKvLayout();
  auto pool = kvferry::KvPool::Allocate(layout);
  if (!pool.ok()) return 1;
  for (uint32_t layer = 0; layer < layout.layers; ++layer) {
    for (uint32_t kv = 0; kv < layout.buffers_per_layer(); ++kv) {
      std::memset(pool->page(layer, kv, 0), layer + 1, layout.buffer_bytes());
    }
  }
  auto sender = kvferry::KvSender::Create(engine, *pool);
  if (!sender.ok()) return 1;
  std::vector<uint32_t> pages(layout.pages);
  for (uint32_t i = 0; i < layout.pages; ++i) pages[i] = i;
  auto h = (*sender)->Begin(absl::GetFlag(FLAGS_kv_request), absl::GetFlag(FLAGS_kv_prefill_to),
                            pages, pages);
  if (!h.ok()) {
    std::fprintf(stderr, "peer_main: %s\n", h.status().ToString().c_str());
    return 1;
  }
  for (uint32_t layer = 0; layer < layout.layers; ++layer) {
    absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_kv_layer_delay_ms)));
    absl::Status sent = (*sender)->SendLayer(*h, layer);
    if (!sent.ok())
      std::fprintf(stderr, "peer_main: layer %u: %s\n", layer, sent.ToString().c_str());
  }
  absl::Status done = (*sender)->Finish(*h, "aux");
  std::printf("FINISHED %s\n", done.ToString().c_str());
  std::fflush(stdout);
  if (const std::string then = absl::GetFlag(FLAGS_kv_then); !then.empty()) {
    absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_kv_then_after_ms)));
    for (uint32_t layer = 0; layer < layout.layers; ++layer) {
      for (uint32_t kv = 0; kv < layout.buffers_per_layer(); ++kv) {
        std::memset(pool->page(layer, kv, 0), layer + 101, layout.buffer_bytes());
      }
    }
    absl::Status second =
        (*sender)->Send(then, absl::GetFlag(FLAGS_kv_prefill_to), pages, pages, "aux2");
    std::printf("FINISHED2 %s\n", second.ToString().c_str());
    std::fflush(stdout);
  }
  for (;;) pause();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The test reads only the READY line: a later print must not kill it.
  std::signal(SIGPIPE, SIG_IGN);
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
  if (!absl::GetFlag(FLAGS_kv_prefill_to).empty()) {
    std::printf("READY %s\n", (*engine)->address().c_str());
    std::fflush(stdout);
    return Prefill(engine->get());
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
