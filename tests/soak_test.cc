// Soak: KV-sized traffic to a peer process over TCP on loopback while the
// peer is SIGKILLed and restarted (same port, new keys, new buffer) at random
// moments. Checked throughout: a request that reports success moved the
// right bytes (read back and compared); every request ends, OK or with an
// error, within a bound. At the end: file descriptors and RSS are back near
// where they were after warm-up, and every request is accounted for.
//
// CI runs the short version (20 s, a kill every 0.5-2.5 s); a longer or
// harsher one is a flag away (KVFERRY_SOAK_KILL_MS: the most milliseconds
// between kills, a fifth of it the least):
//   ./bazelw test //tests:soak_test --test_env=KVFERRY_SOAK_SECONDS=600 --test_timeout=900
//   ./bazelw test //tests:soak_test --test_env=KVFERRY_SOAK_KILL_MS=250
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "sim/prng.h"
#include "tests/peer_process.h"

namespace kvferry {
namespace {

using transport::Opcode;

constexpr uint64_t kPeerBytes = 8 << 20, kPage = 64 << 10;

// The open descriptors: how many, and by kind ("socket", "pipe",
// "anon_inode:[eventfd]", a file's name) for a failure message.
struct OpenFds {
  int count = -1;
  std::string kinds;
};

OpenFds ReadOpenFds() {
  OpenFds out;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return out;
  const int own = dirfd(d);
  std::map<std::string, int> kinds;
  while (dirent* e = readdir(d)) {
    int fd = -1;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == own) continue;
    char target[512];
    const ssize_t n =
        readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof target - 1);
    std::string kind = n > 0 ? std::string(target, n) : "?";
    if (absl::StartsWith(kind, "socket:") || absl::StartsWith(kind, "pipe:")) {
      kind = kind.substr(0, kind.find(':'));
    } else if (kind[0] == '/') {
      kind = kind.substr(kind.rfind('/') + 1);
    }
    ++kinds[kind];
  }
  closedir(d);
  out.count = 0;
  for (const auto& [kind, n] : kinds) {
    out.count += n;
    absl::StrAppend(&out.kinds, " ", kind, " x", n);
  }
  return out;
}

uint64_t RssBytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int n = fallback;
  if (v == nullptr || !absl::SimpleAtoi(v, &n) || n <= 0) n = fallback;
  return n;
}

TEST(Soak, PeerKilledAndRestartedWhileTrafficFlows) {
  const absl::Duration duration = absl::Seconds(EnvInt("KVFERRY_SOAK_SECONDS", 20));
  // Kills [kill_ms / 5, kill_ms) apart (at least 5 ms: Uniform needs n > 0).
  const int kill_ms = std::max(5, EnvInt("KVFERRY_SOAK_KILL_MS", 2500));
  auto first = PeerProcess::StartOnStablePort(kPeerBytes);  // restarted on its port
  ASSERT_TRUE(first.ok()) << first.status();
  const uint16_t port = first->port();
  const std::string address = first->address();
  std::mutex peer_mu;
  PeerProcess peer = std::move(*first);

  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "tcp";
  o.peer_timeout = absl::Seconds(2);
  auto made = TransferEngine::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<TransferEngine> e = std::move(*made);
  std::vector<char> src(kPeerBytes), check(kPeerBytes);
  ASSERT_TRUE(e->RegisterMemory(src.data(), src.size()).ok());
  ASSERT_TRUE(e->RegisterMemory(check.data(), check.size()).ok());

  // The killer: SIGKILL and restart at random moments, 0.5-2.5 s apart.
  std::atomic<bool> stop{false};
  std::atomic<int> kills{0}, restart_failures{0};
  std::string first_restart_error;  // under peer_mu
  std::thread killer([&] {
    sim::Prng prng(20261129);
    while (!stop) {
      const absl::Time at =
          absl::Now() + absl::Milliseconds(kill_ms / 5 + prng.Uniform(kill_ms * 4 / 5));
      while (!stop && absl::Now() < at) absl::SleepFor(absl::Milliseconds(20));
      if (stop) break;
      std::lock_guard<std::mutex> lock(peer_mu);
      peer.Kill();
      ++kills;
      auto next = PeerProcess::Start(port, kPeerBytes);
      if (!next.ok()) {
        if (restart_failures++ == 0) first_restart_error = next.status().ToString();
        continue;
      }
      peer = std::move(*next);
    }
  });

  sim::Prng prng(7);
  std::map<absl::StatusCode, uint64_t> failures;
  std::map<absl::StatusCode, std::string> first_error;  // each code's first message
  auto failure = [&](const absl::Status& st, uint64_t n) {
    failures[st.code()] += n;
    first_error.emplace(st.code(), std::string(st.message()));
  };
  uint64_t requests = 0, succeeded = 0, verified_bytes = 0, batches = 0, unaccounted = 0;
  OpenFds base_fds;
  uint64_t base_rss = 0;
  SegmentId seg = 0;
  uint64_t remote = 0, instance = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < duration) {
    if (base_fds.count < 0 && kills >= 1 && seg != 0) {  // warmed up: one restart survived
      base_fds = ReadOpenFds();
      base_rss = RssBytes();
    }
    if (seg == 0 || remote == 0) {
      auto s = e->OpenSegment(address);
      if (!s.ok()) {
        absl::SleepFor(absl::Milliseconds(50));
        continue;
      }
      seg = *s;
      uint64_t len = 0;
      // The buffer's address is the instance's: batches are bound to it, so
      // that none goes to a successor whose buffer happens to lie there too.
      auto before = e->PeerEngineId(seg);
      auto v = e->FetchMetadata(seg, "buffer");
      auto after = e->PeerEngineId(seg);
      if (!v.ok() || !ParseBuffer(*v, &remote, &len) || len != kPeerBytes || !before.ok() ||
          !after.ok() || *before != *after) {
        remote = 0;
        absl::SleepFor(absl::Milliseconds(50));
        continue;
      }
      instance = *after;
    }
    // A batch of random pages at random places, with fresh bytes.
    const size_t pages = 1 + prng.Uniform(32);
    std::vector<TransferRequest> writes, reads;
    std::set<uint64_t> offsets;  // distinct pages: one write each
    while (offsets.size() < pages) offsets.insert(prng.Uniform(kPeerBytes / kPage) * kPage);
    for (uint64_t off : offsets) {
      const uint64_t stamp = prng.Next64();
      for (uint64_t b = 0; b < kPage; b += 8) std::memcpy(&src[off + b], &stamp, 8);
      writes.push_back({Opcode::kWrite, src.data() + off, remote + off, kPage});
      reads.push_back({Opcode::kRead, check.data() + off, remote + off, kPage});
    }
    bool all_ok = true;
    for (std::vector<TransferRequest>* batch : {&writes, &reads}) {
      if (!all_ok) break;
      ++batches;
      requests += batch->size();
      auto b = e->Submit(seg, *batch, instance);
      if (!b.ok()) {
        failure(b.status(), batch->size());
        all_ok = false;
        break;
      }
      auto st = e->Wait(*b, absl::Seconds(30));
      if (!st.ok() || st->pending > 0) {
        unaccounted += batch->size();
        all_ok = false;
        ADD_FAILURE() << "a batch did not end within 30 s: "
                      << (st.ok() ? std::to_string(st->pending) + " pending" : st.status().ToString());
        break;
      }
      for (const absl::Status& r : st->requests) {
        if (r.ok()) {
          ++succeeded;
        } else {
          failure(r, 1);
          all_ok = false;
        }
      }
      (void)e->Release(*b);
    }
    if (all_ok) {
      // Success was reported for both: the bytes must be the ones written.
      for (const TransferRequest& w : writes) {
        const size_t off = static_cast<char*>(w.local) - src.data();
        ASSERT_EQ(std::memcmp(src.data() + off, check.data() + off, kPage), 0)
            << "a request reported success but the peer holds other bytes";
        verified_bytes += kPage;
      }
    } else {
      remote = 0;  // the peer may have restarted with its buffer elsewhere
    }
  }
  stop = true;
  killer.join();
  const OpenFds end_fds = ReadOpenFds();
  const uint64_t end_rss = RssBytes();
  uint64_t failed = 0;
  std::string by_code;
  for (const auto& [code, n] : failures) {
    failed += n;
    by_code += absl::StrCat(" ", absl::StatusCodeToString(code), "=", n);
  }
  const std::string summary = absl::StrFormat(
      "soak: %.0f s, %d kills survived (%d restarts failed), %llu batches, %llu requests: "
      "%llu OK, %llu failed (%s ), %llu unaccounted; %llu MiB verified; fds %d -> %d, "
      "RSS %.1f -> %.1f MiB",
      absl::ToDoubleSeconds(absl::Now() - start), kills.load(), restart_failures.load(),
      static_cast<unsigned long long>(batches), static_cast<unsigned long long>(requests),
      static_cast<unsigned long long>(succeeded), static_cast<unsigned long long>(failed),
      by_code.c_str(), static_cast<unsigned long long>(unaccounted),
      static_cast<unsigned long long>(verified_bytes >> 20), base_fds.count, end_fds.count,
      base_rss / 1048576.0, end_rss / 1048576.0);
  std::printf("%s\n", summary.c_str());
  SCOPED_TRACE(summary);  // in every failure's message, so in the test's XML too
  EXPECT_EQ(requests, succeeded + failed + unaccounted);
  EXPECT_EQ(unaccounted, 0u);
  EXPECT_GE(kills.load(), 3);
  EXPECT_EQ(restart_failures.load(), 0) << "first: " << first_restart_error;
  EXPECT_GT(succeeded, 0u);
  // Failures are what a dead peer gives, nothing else.
  for (const auto& [code, n] : failures) {
    EXPECT_TRUE(code == absl::StatusCode::kUnavailable ||
                code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound)
        << absl::StatusCodeToString(code) << " x" << n << ", the first: " << first_error[code];
  }
  ASSERT_GE(base_fds.count, 0) << "never warmed up";
  EXPECT_LE(end_fds.count, base_fds.count + 4)
      << "after warm-up:" << base_fds.kinds << "\nat the end:" << end_fds.kinds;
  // Under ASan freed memory waits in its quarantine (256 MiB) before it is
  // reused, so RSS grows by up to that much without a leak (LeakSanitizer
  // checks for leaks at exit there).
#if defined(__SANITIZE_ADDRESS__)
  constexpr uint64_t kRssGrowth = uint64_t{256} << 20;
#else
  constexpr uint64_t kRssGrowth = uint64_t{32} << 20;
#endif
  EXPECT_LE(end_rss, base_rss + kRssGrowth)
      << "RSS grew by " << (end_rss - base_rss) / 1048576.0 << " MiB";
}

}  // namespace
}  // namespace kvferry
