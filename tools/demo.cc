// kvferry demo: a prefill engine sends KV-cache pages to a decode engine,
// with zero configuration.
//
//   ./bazelw run //tools:demo                    # both roles, two processes
//   ./bazelw run //tools:demo -- --role=decode   # on machine B: prints its address
//   ./bazelw run //tools:demo -- --role=prefill --peer=B:15000   # on machine A
//
// The prefill side learns where the decode pool is from the handshake alone.
//
// The KV pool is laid out like a real model's: per layer a K and a V buffer
// of `pool_pages` pages, each page `page_tokens` tokens of `kv_heads` x
// `head_dim` bf16 values. Through the KV layer (engine/kv_cache.h) the
// prefill side sends `requests` concurrent requests of `pages` scattered
// pages each, layer by layer; the decode side checks every page of every
// layer by checksum when each request completes, and reports back.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"
#include "sim/prng.h"

ABSL_FLAG(std::string, role, "both", "both (two local processes), prefill or decode");
ABSL_FLAG(std::string, peer, "", "prefill: the decode engine's host:port");
ABSL_FLAG(std::string, host, "", "address to advertise (default: detected)");
ABSL_FLAG(uint16_t, port, 0, "handshake port (default: first free from 15000)");
ABSL_FLAG(std::string, transport, "auto", "auto, tcp or rdma");
ABSL_FLAG(uint32_t, layers, 32, "model layers");
ABSL_FLAG(uint32_t, page_tokens, 16, "tokens per page");
ABSL_FLAG(uint32_t, kv_heads, 8, "KV heads");
ABSL_FLAG(uint32_t, head_dim, 128, "head dimension (bf16 values)");
ABSL_FLAG(uint32_t, pool_pages, 256, "pages per layer buffer in each pool");
ABSL_FLAG(uint32_t, requests, 8, "concurrent requests");
ABSL_FLAG(uint32_t, pages, 24, "pages per request (scattered)");
ABSL_FLAG(uint64_t, seed, 1, "seed for the page choice and contents");
ABSL_FLAG(bool, cancel_last, false,
          "cancel the last request after its first layer (both sides must see it fail)");
ABSL_FLAG(uint32_t, kill_prefill_after, 0,
          "both roles: a first prefill process sends this many layers of every request and "
          "is killed; the decode reports each request failed and how long it took to see it, "
          "then serves a second prefill (0: off)");
ABSL_FLAG(bool, verbose, false, "show the engines' log lines");

namespace kvferry {
namespace {

using transport::Opcode;

struct Layout {
  uint32_t layers, pool_pages;
  uint64_t page_bytes;
  uint64_t buffer_bytes() const { return page_bytes * pool_pages; }
  uint64_t pool_bytes() const { return buffer_bytes() * layers * 2; }
  // Offset of (layer, k_or_v, page) in the pool.
  uint64_t Offset(uint32_t layer, uint32_t kv, uint32_t page) const {
    return (uint64_t(layer) * 2 + kv) * buffer_bytes() + uint64_t(page) * page_bytes;
  }
};

Layout MakeLayout() {
  return Layout{absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_pool_pages),
                uint64_t{absl::GetFlag(FLAGS_page_tokens)} * absl::GetFlag(FLAGS_kv_heads) *
                    absl::GetFlag(FLAGS_head_dim) * 2};
}

// The contents of source page (layer, kv, page): a deterministic stream.
void FillPage(char* out, uint64_t bytes, uint64_t seed, uint32_t layer, uint32_t kv,
              uint32_t page) {
  sim::Prng prng(seed ^ (uint64_t(layer) << 40) ^ (uint64_t(kv) << 32) ^ page);
  for (uint64_t i = 0; i < bytes; i += 8) {
    const uint64_t w = prng.Next64();
    std::memcpy(out + i, &w, std::min<uint64_t>(8, bytes - i));
  }
}

uint64_t Checksum(const char* p, uint64_t n) {  // FNV-1a, 64-bit
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ULL;
  return h;
}

void PrintDetection(const char* role, const TransferEngine& e) {
  const Detection& d = e.detection();
  std::printf("  %-8s engine at %s (pid %d)\n", role, e.address().c_str(), ::getpid());
  std::printf("           address   %s — %s\n", d.host.c_str(), d.host_reason.c_str());
  std::printf("           transport %s — %s\n", d.transport.c_str(), d.transport_reason.c_str());
  std::printf("           devices   %s\n", d.devices.c_str());
  std::fflush(stdout);
}

absl::StatusOr<std::unique_ptr<TransferEngine>> StartEngine() {
  EngineOptions o;
  o.local_host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.transport = absl::GetFlag(FLAGS_transport);
  return TransferEngine::Create(o);
}

// The pages request r uses on each side: a seeded, scattered, disjoint
// choice (the same on both sides, so the decode side can check them).
struct Plan {
  std::vector<std::vector<uint32_t>> src, dst;  // per request
};

Plan MakePlan(const Layout& layout, uint64_t seed, uint32_t requests, uint32_t pages) {
  sim::Prng prng(seed);
  std::vector<uint32_t> src(layout.pool_pages), dst(layout.pool_pages);
  for (uint32_t i = 0; i < layout.pool_pages; ++i) src[i] = dst[i] = i;
  for (uint32_t i = layout.pool_pages - 1; i > 0; --i) {
    std::swap(src[i], src[prng.Uniform(i + 1)]);
    std::swap(dst[i], dst[prng.Uniform(i + 1)]);
  }
  Plan plan;
  for (uint32_t r = 0; r < requests; ++r) {
    plan.src.emplace_back(src.begin() + r * pages, src.begin() + (r + 1) * pages);
    plan.dst.emplace_back(dst.begin() + r * pages, dst.begin() + (r + 1) * pages);
  }
  return plan;
}

KvLayout ToKvLayout(const Layout& layout) {
  return KvLayout{layout.layers, false, absl::GetFlag(FLAGS_page_tokens),
                  layout.page_bytes / absl::GetFlag(FLAGS_page_tokens), layout.pool_pages};
}

absl::Status CheckFlags(const Layout& layout) {
  const uint64_t want = uint64_t{absl::GetFlag(FLAGS_requests)} * absl::GetFlag(FLAGS_pages);
  if (absl::GetFlag(FLAGS_requests) == 0 || absl::GetFlag(FLAGS_pages) == 0 ||
      want > layout.pool_pages) {
    return absl::InvalidArgumentError(absl::StrCat("--requests x --pages (", want,
                                                   ") must be between 1 and --pool_pages (",
                                                   layout.pool_pages, ")"));
  }
  return absl::OkStatus();
}

// Decode: receives every request through the KV layer, checks every page of
// every layer by checksum, and reports "verified N/M" to the prefill.
// Waits for a prefill's "demo-prefill <host:port> <engine id>" and
// declares every request as expected from it (KvReceiver::Expect): if it
// dies, the decode hears of it.
bool ExpectFromNextPrefill(TransferEngine& engine, KvReceiver& receiver, uint32_t requests,
                           const std::string& prefix) {
  const absl::Time deadline = absl::Now() + absl::Minutes(5);
  while (absl::Now() < deadline) {
    // The receiver keeps what is not a KV word (it may have taken the
    // announcement while waiting for requests).
    std::vector<Notification> notes = receiver.TakeOtherNotifications();
    if (notes.empty()) {
      auto n = engine.WaitNotification(absl::Milliseconds(100));
      if (n.ok()) notes.push_back(std::move(*n));
    }
    for (const Notification& n : notes) {
      std::vector<std::string> w = absl::StrSplit(n.message, ' ');
      uint64_t id = 0;
      if (w.size() != 3 || w[0] != "demo-prefill" || !absl::SimpleAtoi(w[2], &id)) continue;
      for (uint32_t r = 0; r < requests; ++r) {
        if (!receiver.Expect(absl::StrCat(prefix, r), w[1], id).ok()) return false;
      }
      return true;
    }
  }
  return false;
}

int RunDecode(int report_fd, int death_fd) {
  const Layout layout = MakeLayout();
  if (absl::Status s = CheckFlags(layout); !s.ok()) {
    std::fprintf(stderr, "decode: %s\n", s.ToString().c_str());
    return 2;
  }
  auto engine = StartEngine();
  if (!engine.ok()) {
    std::fprintf(stderr, "decode: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  auto pool = KvPool::Allocate(ToKvLayout(layout));
  auto receiver = pool.ok() ? KvReceiver::Create(engine->get(), *pool)
                            : absl::StatusOr<std::unique_ptr<KvReceiver>>(pool.status());
  if (!receiver.ok()) {
    std::fprintf(stderr, "decode: %s\n", receiver.status().ToString().c_str());
    return 1;
  }
  PrintDetection("decode", **engine);
  const std::string address = (*engine)->address();
  if (report_fd >= 0) {
    const std::string line = address + "\n";
    if (::write(report_fd, line.data(), line.size()) != ssize_t(line.size())) return 1;
    ::close(report_fd);
  } else {
    std::printf("  waiting; on the prefill machine run: demo --role=prefill --peer=%s\n",
                address.c_str());
    std::fflush(stdout);
  }
  const uint32_t requests = absl::GetFlag(FLAGS_requests);
  if (absl::GetFlag(FLAGS_kill_prefill_after) > 0) {
    // The first prefill dies mid-request: every request it was sending
    // fails here, within the receiver's peer_timeout of its death.
    if (!ExpectFromNextPrefill(**engine, **receiver, requests, "lost-")) return 1;
    absl::Time seen = absl::InfinitePast();
    std::string why;
    for (uint32_t r = 0; r < requests; ++r) {
      auto st = (*receiver)->Wait(absl::StrCat("lost-", r), absl::Minutes(1));
      if (!st.ok() || st->state != KvReceiver::State::kFailed) {
        std::fprintf(
            stderr, "decode: req-%u: %s\n", r,
            !st.ok() ? st.status().ToString().c_str() : "completed although its prefill died");
        return 1;
      }
      seen = std::max(seen, absl::Now());
      why = st->error.ToString();
      (*receiver)->Forget(absl::StrCat("lost-", r));
    }
    int64_t died_ns = 0;
    if (death_fd < 0 || ::read(death_fd, &died_ns, sizeof died_ns) != sizeof died_ns) {
      std::fprintf(stderr, "decode: no word of the prefill's death\n");
      return 1;
    }
    std::printf(
        "  decode   the prefill died mid-request: all %u requests reported failed %.0f ms "
        "after its death (%s)\n",
        requests, absl::ToDoubleMilliseconds(seen - absl::FromUnixNanos(died_ns)), why.c_str());
    std::printf("  decode   serving the next prefill\n");
    std::fflush(stdout);
  }
  if (!ExpectFromNextPrefill(**engine, **receiver, requests, "req-")) return 1;
  uint64_t checked = 0, good = 0, seed = 0;
  std::string prefill;
  std::vector<char> expected(layout.page_bytes);
  const bool cancel_last = absl::GetFlag(FLAGS_cancel_last);
  uint32_t cancelled = 0;
  for (uint32_t r = 0; r < requests; ++r) {
    auto st = (*receiver)->Wait(absl::StrCat("req-", r), absl::Hours(1));
    if (!st.ok()) return 1;
    if (cancel_last && r + 1 == requests) {
      if (st->state != KvReceiver::State::kFailed ||
          st->error.message().find("cancelled") == absl::string_view::npos) {
        return 1;
      }
      ++cancelled;
      continue;
    }
    if (st->state != KvReceiver::State::kComplete) return 1;
    // aux: "<prefill address> <seed>"
    std::pair<std::string, std::string> aux = absl::StrSplit(st->aux, ' ');
    prefill = aux.first;
    if (!absl::SimpleAtoi(aux.second, &seed)) return 1;
    const Plan plan = MakePlan(layout, seed, requests, absl::GetFlag(FLAGS_pages));
    for (size_t i = 0; i < plan.src[r].size(); ++i) {
      for (uint32_t layer = 0; layer < layout.layers; ++layer) {
        for (uint32_t kv = 0; kv < 2; ++kv) {
          FillPage(expected.data(), layout.page_bytes, seed, layer, kv, plan.src[r][i]);
          const char* got = (*pool).page(layer, kv, plan.dst[r][i]);
          ++checked;
          good += Checksum(got, layout.page_bytes) == Checksum(expected.data(), layout.page_bytes);
        }
      }
    }
  }
  auto back = (*engine)->OpenSegment(prefill);
  if (back.ok()) {
    (void)(*engine)->Notify(*back, absl::StrCat("verified ", good, "/", checked,
                                                cancelled ? ", 1 request seen cancelled" : ""));
  }
  return good == checked ? 0 : 1;
}

// `kill_after` > 0: sends that many layers of every request, then the
// process kills itself (a prefill crashing mid-request).
int RunPrefill(const std::string& peer, uint32_t kill_after = 0) {
  const Layout layout = MakeLayout();
  if (absl::Status s = CheckFlags(layout); !s.ok()) {
    std::fprintf(stderr, "prefill: %s\n", s.ToString().c_str());
    return 2;
  }
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const uint32_t requests = absl::GetFlag(FLAGS_requests);
  const uint32_t pages = absl::GetFlag(FLAGS_pages);
  auto engine = StartEngine();
  if (!engine.ok()) {
    std::fprintf(stderr, "prefill: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  PrintDetection("prefill", **engine);
  auto pool = KvPool::Allocate(ToKvLayout(layout));
  if (!pool.ok()) return 1;
  for (uint32_t layer = 0; layer < layout.layers; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t p = 0; p < layout.pool_pages; ++p) {
        FillPage(pool->page(layer, kv, p), layout.page_bytes, seed, layer, kv, p);
      }
    }
  }
  auto sender = KvSender::Create(engine->get(), *pool);
  if (!sender.ok()) {
    std::fprintf(stderr, "prefill: %s\n", sender.status().ToString().c_str());
    return 1;
  }
  // Who is sending (the decode expects the requests from this engine).
  auto to = (*engine)->OpenSegment(peer);
  absl::Status announced =
      to.ok() ? (*engine)->Notify(*to, absl::StrCat("demo-prefill ", (*engine)->address(), " ",
                                                    (*engine)->engine_id()))
              : to.status();
  if (!announced.ok()) {
    std::fprintf(stderr, "prefill: %s\n", announced.ToString().c_str());
    return 1;
  }
  const Plan plan = MakePlan(layout, seed, requests, pages);
  const absl::Time t0 = absl::Now();
  std::vector<KvSender::Handle> handles;
  for (uint32_t r = 0; r < requests; ++r) {
    auto h = (*sender)->Begin(absl::StrCat(kill_after > 0 ? "lost-" : "req-", r), peer, plan.src[r],
                              plan.dst[r]);
    if (!h.ok()) {
      std::fprintf(stderr, "prefill: %s\n", h.status().ToString().c_str());
      return 1;
    }
    handles.push_back(*h);
  }
  const absl::Duration handshake = absl::Now() - t0;
  // All requests in flight at once, each layer sent as soon as it is "ready".
  const absl::Time start = absl::Now();
  const bool cancel_last = absl::GetFlag(FLAGS_cancel_last);
  for (uint32_t layer = 0; layer < layout.layers; ++layer) {
    if (kill_after > 0 && layer == kill_after) {
      absl::SleepFor(absl::Milliseconds(100));  // let those layers land
      std::printf("  prefill  sent %u of %u layers of every request; now it dies (SIGKILL)\n",
                  kill_after, layout.layers);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    for (KvSender::Handle h : handles) {
      if (cancel_last && h == handles.back() && layer > 0) continue;
      if (absl::Status s = (*sender)->SendLayer(h, layer); !s.ok()) {
        std::fprintf(stderr, "prefill: layer %u: %s\n", layer, s.ToString().c_str());
        return 1;
      }
    }
  }
  std::vector<double> latency_ms;
  const std::string aux = absl::StrCat((*engine)->address(), " ", seed);
  if (cancel_last) {
    if (absl::Status s = (*sender)->Cancel(handles.back(), "demo --cancel_last"); !s.ok()) {
      std::fprintf(stderr, "prefill: cancel: %s\n", s.ToString().c_str());
      return 1;
    }
    handles.pop_back();
  }
  for (KvSender::Handle h : handles) {
    if (absl::Status s = (*sender)->Finish(h, aux); !s.ok()) {
      std::fprintf(stderr, "prefill: %s\n", s.ToString().c_str());
      return 1;
    }
    latency_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  auto verdict = (*engine)->WaitNotification(absl::Seconds(120));
  const uint32_t completed = requests - (cancel_last ? 1 : 0);
  const double bytes = double(completed) * pages * 2 * layout.layers * layout.page_bytes;
  const uint64_t total = uint64_t{completed} * pages * 2 * layout.layers;
  std::printf(
      "  model    %u layers x K,V x %u-token pages x %u heads x %u dims bf16 = %s per page\n",
      layout.layers, absl::GetFlag(FLAGS_page_tokens), absl::GetFlag(FLAGS_kv_heads),
      absl::GetFlag(FLAGS_head_dim),
      absl::StrFormat("%.0f KiB", layout.page_bytes / 1024.0).c_str());
  std::printf("  handshake %.1f ms (descriptors, links, the decode pool's layout)\n",
              absl::ToDoubleMilliseconds(handshake));
  std::printf(
      "  sent     %u concurrent requests x %u scattered pages, layer by layer: "
      "%.1f MiB in %.3f s = %.2f GB/s%s\n",
      requests, pages, bytes / (1 << 20), seconds, bytes / seconds / 1e9,
      cancel_last ? " (the last one cancelled after layer 0)" : "");
  std::string per_request;
  for (size_t r = 0; r < latency_ms.size(); ++r) {
    absl::StrAppend(&per_request, r ? ", " : "", absl::StrFormat("%.1f", latency_ms[r]));
  }
  std::printf("  latency  per request, ms from the first layer to complete: %s\n",
              per_request.c_str());
  const bool ok = verdict.ok() &&
                  verdict->message == absl::StrCat("verified ", total, "/", total,
                                                   cancel_last ? ", 1 request seen cancelled" : "");
  std::printf("  decode   %s page buffers by checksum\n",
              verdict.ok() ? verdict->message.c_str() : "no verdict");
  std::printf("%s\n", ok ? "OK: every page arrived intact." : "FAILED");
  return ok ? 0 : 1;
}

// How this binary was compiled, for the throughput line's reader.
const char* BuildMode() {
#ifdef __OPTIMIZE__
  return "optimized build (-c opt)";
#else
  return "UNOPTIMIZED build (fastbuild or dbg): the throughput understates the engine; "
         "./bazelw run builds -c opt";
#endif
}

int RunBoth() {
  int pipefd[2], deathfd[2];
  if (::pipe(pipefd) != 0 || ::pipe(deathfd) != 0) return 1;
  std::printf("kvferry demo: a prefill and a decode engine, two processes, zero configuration\n");
  std::printf("  %s\n", BuildMode());
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child < 0) return 1;
  if (child == 0) {
    ::close(pipefd[0]);
    ::close(deathfd[1]);
    ::_exit(RunDecode(pipefd[1], deathfd[0]));
  }
  ::close(pipefd[1]);
  ::close(deathfd[0]);
  std::string line;
  char c;
  while (::read(pipefd[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  ::close(pipefd[0]);
  int rc = line.empty() ? 1 : 0;
  const uint32_t kill_after = absl::GetFlag(FLAGS_kill_prefill_after);
  if (rc == 0 && kill_after > 0) {
    // A first prefill in a process of its own, which dies mid-request.
    const pid_t victim = ::fork();
    if (victim < 0) return 1;
    if (victim == 0) ::_exit(RunPrefill(line, kill_after));
    int status = 0;
    ::waitpid(victim, &status, 0);
    const int64_t died = absl::ToUnixNanos(absl::Now());
    rc = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL &&
                 ::write(deathfd[1], &died, sizeof died) == sizeof died
             ? 0
             : 1;
  }
  ::close(deathfd[1]);
  if (rc == 0) rc = RunPrefill(line);
  if (rc != 0) ::kill(child, SIGTERM);  // it would wait for requests forever
  int status = 0;
  ::waitpid(child, &status, 0);
  const bool decode_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return rc == 0 && decode_ok ? 0 : 1;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "sends KV-cache pages from a prefill engine to a decode engine.\n"
      "  ./bazelw run //tools:demo\n"
      "  ./bazelw run //tools:demo -- --role=decode\n"
      "  ./bazelw run //tools:demo -- --role=prefill --peer=HOST:PORT");
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_verbose)) kvferry::SetLogThreshold(kvferry::LogSeverity::kWarning);
  const std::string role = absl::GetFlag(FLAGS_role);
  const uint32_t kill_after = absl::GetFlag(FLAGS_kill_prefill_after);
  if (kill_after > 0 && (role != "both" || kill_after >= absl::GetFlag(FLAGS_layers))) {
    std::fprintf(stderr, "demo: --kill_prefill_after needs --role=both and fewer than --layers\n");
    return 2;
  }
  if (role == "both") return kvferry::RunBoth();
  if (role == "decode") return kvferry::RunDecode(-1, -1);
  if (role == "prefill") {
    if (absl::GetFlag(FLAGS_peer).empty()) {
      std::fprintf(stderr,
                   "demo: --role=prefill needs --peer=HOST:PORT (printed by --role=decode)\n");
      return 2;
    }
    return kvferry::RunPrefill(absl::GetFlag(FLAGS_peer));
  }
  std::fprintf(stderr, "demo: --role must be both, prefill or decode\n");
  return 2;
}
