// Starts tests/peer_main in a child process and controls it (freeze, thaw,
// kill), for tests of peer failure across processes.
#ifndef KVFERRY_TESTS_PEER_PROCESS_H_
#define KVFERRY_TESTS_PEER_PROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace kvferry {

class PeerProcess {
 public:
  // Spawns peer_main (from the test's runfiles) and waits for its READY line.
  // `extra` are more flags for peer_main.
  static absl::StatusOr<PeerProcess> Start(uint16_t port, uint64_t bytes,
                                           absl::Duration timeout = absl::Seconds(20),
                                           std::vector<std::string> extra = {}) {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* ws = std::getenv("TEST_WORKSPACE");
    if (srcdir == nullptr || ws == nullptr)
      return absl::FailedPreconditionError("not under bazel test");
    const std::string bin = absl::StrCat(srcdir, "/", ws, "/tests/peer_main");
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<std::string> args = {bin, absl::StrCat("--port=", port),
                                     absl::StrCat("--bytes=", bytes)};
    for (std::string& a : extra) args.push_back(std::move(a));
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    PeerProcess p;
    const int rc = posix_spawn(&p.pid_, bin.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    if (rc != 0) {
      close(out[0]);
      return absl::InternalError(absl::StrCat("posix_spawn ", bin, ": ", rc));
    }
    std::string line;
    const absl::Time deadline = absl::Now() + timeout;
    while (line.find('\n') == std::string::npos) {
      pollfd pfd{out[0], POLLIN, 0};
      const int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      char buf[256];
      ssize_t n = ms > 0 && poll(&pfd, 1, ms) > 0 ? read(out[0], buf, sizeof(buf)) : 0;
      if (n <= 0) break;
      line.append(buf, n);
    }
    close(out[0]);
    std::vector<std::string> words = absl::StrSplit(line, absl::ByAnyChar(" \n"));
    if (words.size() < 2 || words[0] != "READY") {
      p.Kill();
      return absl::UnavailableError(absl::StrCat("peer_main did not start: '", line, "'"));
    }
    p.address_ = words[1];
    return p;
  }

  // Starts on a port below the kernel's ephemeral range, which it never
  // hands out for a bind to port 0 or an outgoing connection: for tests that
  // kill the peer and restart it on its port. A port that was ephemeral can
  // be taken meanwhile by any process (another test's engine, run in
  // parallel), and the restarted peer then cannot listen, or another test's
  // peer answers in its place. Tries random ports until one is free.
  static absl::StatusOr<PeerProcess> StartOnStablePort(uint64_t bytes) {
    int lo = 32768, hi = 60999;
    if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
      if (std::fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768;
      std::fclose(f);
    }
    const int first = std::max(1024, lo - 12000);
    if (lo - first < 100) return Start(0, bytes);  // no room below the range
    uint64_t seed = static_cast<uint64_t>(getpid()) * 2654435761u ^
                    static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    absl::Status last;
    for (int attempt = 0; attempt < 20; ++attempt) {
      seed = seed * 6364136223846793005u + 1442695040888963407u;
      const uint16_t port = static_cast<uint16_t>(first + (seed >> 33) % (lo - first));
      absl::StatusOr<PeerProcess> p = Start(port, bytes);
      if (p.ok()) return p;
      last = p.status();
    }
    return last;
  }

  PeerProcess() = default;
  PeerProcess(PeerProcess&& o) noexcept : pid_(o.pid_), address_(std::move(o.address_)) {
    o.pid_ = 0;
  }
  PeerProcess& operator=(PeerProcess&& o) noexcept {
    Kill();
    pid_ = o.pid_;
    address_ = std::move(o.address_);
    o.pid_ = 0;
    return *this;
  }
  ~PeerProcess() { Kill(); }

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  uint16_t port() const {
    uint32_t p = 0;
    (void)absl::SimpleAtoi(address_.substr(address_.rfind(':') + 1), &p);
    return static_cast<uint16_t>(p);
  }
  // SIGSTOP, and waits until every thread of it has stopped (kill() only
  // queues the signal: a thread may still answer a request meanwhile).
  void Freeze() {
    if (pid_ <= 0 || kill(pid_, SIGSTOP) != 0) return;
    int st = 0;
    pid_t r;
    while ((r = waitpid(pid_, &st, WUNTRACED)) < 0 && errno == EINTR) {
    }
    if (r == pid_ && (WIFEXITED(st) || WIFSIGNALED(st))) pid_ = 0;  // it died first: reaped
  }
  void Thaw() {
    if (pid_ > 0) kill(pid_, SIGCONT);
  }
  // SIGKILL and reap.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }

 private:
  pid_t pid_ = 0;
  std::string address_;
};

// Parses peer_main's "buffer" metadata: "<address> <length>".
inline bool ParseBuffer(const std::string& value, uint64_t* addr, uint64_t* length) {
  std::vector<std::string> w = absl::StrSplit(value, ' ');
  return w.size() == 2 && absl::SimpleAtoi(w[0], addr) && absl::SimpleAtoi(w[1], length);
}

}  // namespace kvferry

#endif  // KVFERRY_TESTS_PEER_PROCESS_H_
