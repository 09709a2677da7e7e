// The check on a real GPU (tools/gpu/check.sh runs it from the bundle
// tools/gpu/bundle.sh makes): device memory moved between two processes of
// this host, over TCP staging, over CUDA IPC (cudaMalloc memory) and as
// VMM memory through POSIX fds, each transfer verified in the receiving
// process by a hash of the bytes it reads back through the driver after the
// sender's Wait; on each path also a stream-ordered WRITE
// (SubmitOnStream behind an asynchronous device-to-device copy that makes
// the bytes it sends) and a KV request over device pools with checksums.
// Throughput beside a device-to-device cuMemcpy and a host-to-host TCP
// stream of the same bytes, measured in the same run. Ends with
// "N passed, N failed".
//
//   gpu_check [--mib=256] [--rounds=3] [--src_device=0] [--dst_device=N]
//
// KVFERRY_CUDA_LIBRARY names another driver library (CI runs it against the
// fake one).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "cuda/driver.h"
#include "engine/transfer_engine.h"
#include "kv/kv_cache.h"
#include "tools/gpu/two_process.h"

ABSL_FLAG(int, mib, 256, "bytes moved per transfer, MiB");
ABSL_FLAG(int, rounds, 3, "transfers per path (the best rate is reported)");
ABSL_FLAG(int, src_device, 0, "CUDA ordinal of the sending process's buffer");
ABSL_FLAG(int, dst_device, -1, "CUDA ordinal of the receiving buffer (-1: the last device)");

namespace kvferry {
namespace {

int passed = 0, failed = 0;

void Check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  ++(ok ? passed : failed);
}

using gpu::Fnv;
using gpu::ReadLine;
using gpu::WriteLine;

// The hash of device memory, read back through the driver.
uint64_t DeviceHash(const cuda::Driver* d, const void* p, size_t n, int device) {
  std::vector<char> host(n);
  return d->Copy(host.data(), p, n, device).ok() ? Fnv(host) : 0;
}

// The KV check's pools: 4 layers, K and V, 64 pages of 32 KiB (vLLM's
// 16-token blocks) per buffer, on each side's device.
constexpr KvLayout kKvLayout{4, false, 16, 2048, 64};

// A device pool of kKvLayout on `device`, each buffer filled with `seed`'s
// pattern (seed 0: left as allocated); its buffers in *buffers.
absl::StatusOr<KvPool> DevicePool(const cuda::Driver* d, int device, int seed,
                                  std::vector<void*>* buffers) {
  std::vector<char> fill(kKvLayout.buffer_bytes());
  for (uint32_t b = 0; b < kKvLayout.buffer_count(); ++b) {
    void* p = d->AllocDevice(device, fill.size()).value_or(nullptr);
    if (p == nullptr) return absl::ResourceExhaustedError("cuMemAlloc for the KV pool");
    buffers->push_back(p);
    if (seed == 0) continue;
    for (size_t i = 0; i < fill.size(); i += 64) fill[i] = static_cast<char>(i / 64 * seed + b);
    if (absl::Status st = d->Copy(p, fill.data(), fill.size(), device); !st.ok()) return st;
  }
  return KvPool::Wrap(kKvLayout, *buffers);
}

// The hash of a pool's buffers one after the other, read through the driver.
uint64_t PoolHash(const cuda::Driver* d, const std::vector<void*>& buffers, int device) {
  std::vector<char> all, one(kKvLayout.buffer_bytes());
  for (void* p : buffers) {
    if (!d->Copy(one.data(), p, one.size(), device).ok()) return 0;
    all.insert(all.end(), one.begin(), one.end());
  }
  return Fnv(all);
}

// The three paths: staged over TCP (IPC off), cudaMalloc memory through a
// CUDA IPC handle, and VMM memory (PyTorch's expandable segments) through
// its chunks' POSIX fds.
// And, where the host has an RDMA device, the NIC reading and writing
// cudaMalloc memory (dma-buf or nvidia-peermem), over the RDMA transport
// alone.
enum class Mode { kStaged, kIpc, kVmm, kVerbs };

// One link: as many connections as the host TCP reference; large slices.
std::unique_ptr<TransferEngine> Engine(Mode mode) {
  if (mode == Mode::kVerbs) {
    EngineOptions o;
    o.transport = "rdma";
    o.links_per_peer = 1;
    o.slice_bytes = 4 << 20;
    auto e = TransferEngine::Create(o);
    if (!e.ok()) std::printf("rdma engine: %s\n", e.status().ToString().c_str());
    return e.ok() ? std::move(*e) : nullptr;
  }
  return gpu::LoopbackEngine(mode != Mode::kStaged, /*links=*/1, /*slice_bytes=*/4 << 20);
}

// Device memory for `bytes`: VMM memory in 20 MiB chunks (PyTorch's large
// pool), else cuMemAlloc. Free releases it.
struct DeviceBuffer {
  void* p = nullptr;
  uint64_t chunk = 0;
  int chunks = 0;
  int device = 0;
};
DeviceBuffer Alloc(const cuda::Driver* d, Mode mode, size_t bytes, int device) {
  DeviceBuffer b;
  b.device = device;
  if (mode != Mode::kVmm) {
    b.p = d->AllocDevice(device, bytes).value_or(nullptr);
    return b;
  }
  const uint64_t g = d->VmmGranularity(device).value_or(0);
  if (g == 0) return b;
  b.chunk = ((20 << 20) + g - 1) / g * g;
  b.chunks = static_cast<int>((bytes + b.chunk - 1) / b.chunk);
  b.p = d->AllocVmm(device, b.chunk, b.chunks).value_or(nullptr);
  return b;
}
void Free(const cuda::Driver* d, const DeviceBuffer& b) {
  if (b.p == nullptr) return;
  if (b.chunks > 0) {
    (void)d->FreeVmm(b.p, b.chunk, b.chunks, b.device);
  } else {
    (void)d->FreeDevice(b.p, b.device);
  }
}

// The receiving process: a device buffer registered with an engine (IPC on
// or off), and a TCP sink for the host-to-host reference. Answers "h" with
// the hash of its buffer; ends at EOF.
[[noreturn]] void Receiver(int in, int out, Mode mode, size_t bytes, int device) {
  const cuda::Driver* d = cuda::Driver::Get();
  auto engine = d != nullptr ? Engine(mode) : nullptr;
  void* dst = engine != nullptr ? Alloc(d, mode, bytes, device).p : nullptr;
  if (dst == nullptr || !engine->RegisterMemory(dst, bytes).ok()) {
    WriteLine(out, "error");
    _exit(2);
  }
  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    _exit(3);
  }
  std::vector<void*> kv_buffers;
  absl::StatusOr<KvPool> pool = DevicePool(d, device, 0, &kv_buffers);
  auto kv = pool.ok() ? KvReceiver::Create(engine.get(), *std::move(pool))
                      : absl::StatusOr<std::unique_ptr<KvReceiver>>(pool.status());
  if (!kv.ok()) {
    WriteLine(out, "error");
    _exit(2);
  }
  WriteLine(out, engine->address() + " " + std::to_string(reinterpret_cast<uintptr_t>(dst)) + " " +
                     std::to_string(ntohs(sa.sin_port)));
  std::vector<char> sink(1 << 20);
  for (;;) {
    const std::string cmd = ReadLine(in);
    if (cmd == "h") {
      WriteLine(out, std::to_string(DeviceHash(d, dst, bytes, device)));
    } else if (cmd.rfind("k ", 0) == 0) {  // a KV request: its outcome, the pool's hash
      auto st = (*kv)->Wait(cmd.substr(2), absl::Seconds(120));
      const bool complete = st.ok() && st->state == KvReceiver::State::kComplete;
      if (!complete) {
        std::printf("KV request: %s\n",
                    st.ok() ? st->error.ToString().c_str() : st.status().ToString().c_str());
      }
      WriteLine(out, std::string(complete ? "1 " : "0 ") +
                         std::to_string(PoolHash(d, kv_buffers, device)));
    } else if (cmd == "s") {  // the reference stream: take `bytes`, then say so
      const int c = accept(lfd, nullptr, nullptr);
      size_t got = 0;
      while (got < bytes) {
        const ssize_t r = recv(c, sink.data(), sink.size(), 0);
        if (r <= 0) break;
        got += static_cast<size_t>(r);
      }
      close(c);
      WriteLine(out, std::to_string(got));
    } else {
      kv->reset();
      engine.reset();  // its threads end before the process does
      _exit(0);
    }
  }
}

struct PathResult {
  double best_gbps = 0;
  bool ok = false;
  bool stream_ok = false;  // the stream-ordered WRITE landed whole, verified
  bool kv_ok = false;      // the checksummed KV request completed, verified
};

// A stream-ordered WRITE of [src, +bytes): the bytes are made on a stream
// by an asynchronous device-to-device copy from a second buffer, and the
// WRITE is queued behind it (SubmitOnStream), so it lands the second
// buffer's bytes only if it waited for the copy. True when it succeeded;
// *sent gets the bytes the peer must now hold.
bool StreamOrderedWrite(const cuda::Driver* d, TransferEngine* engine, SegmentId seg, void* src,
                        uint64_t remote, size_t bytes, int device, std::vector<char>* sent) {
  void* next = d->AllocDevice(device, bytes).value_or(nullptr);
  auto stream = d->CreateStream(device);
  bool ok = next != nullptr && stream.ok();
  for (size_t i = 0; i < bytes; i += 8) (*sent)[i] = static_cast<char>(i / 8 * 7 + 101);
  ok = ok && d->Copy(next, sent->data(), bytes, device).ok() &&
       d->CopyAsync(src, next, bytes, *stream, device).ok();
  if (ok) {
    TransferRequest w{transport::Opcode::kWrite, src, remote, bytes};
    StreamOptions options;
    options.timeout = absl::Seconds(120);
    auto id = engine->SubmitOnStream(seg, {&w, 1}, *stream, options);
    // hold_stream: the stream's synchronization comes after the transfer.
    ok = id.ok() && d->Synchronize(*stream, device).ok();
    auto st = id.ok() ? engine->WaitOnStream(*id, absl::Seconds(10)) : id.status();
    ok = ok && st.ok() && st->ok();
    if (!ok) {
      std::printf("stream-ordered WRITE: %s\n",
                  st.ok() ? "a request failed" : st.status().ToString().c_str());
    }
  }
  if (stream.ok()) d->DestroyStream(*stream, device);
  if (next != nullptr) (void)d->FreeDevice(next, device);
  return ok;
}

// A KV request of every page of a device pool on this process's device to
// the peer's KvReceiver, with checksums; true when it was sent. *expected
// gets the hash the peer's pool must then have.
bool ChecksummedKv(const cuda::Driver* d, TransferEngine* engine, const std::string& peer,
                   int device, uint64_t* expected) {
  std::vector<void*> buffers;
  absl::StatusOr<KvPool> pool = DevicePool(d, device, 13, &buffers);
  if (!pool.ok()) return false;
  *expected = PoolHash(d, buffers, device);
  KvSender::Options options;
  options.checksums = true;
  auto sender = KvSender::Create(engine, *std::move(pool), options);
  std::vector<uint32_t> pages(kKvLayout.pages);
  for (uint32_t i = 0; i < kKvLayout.pages; ++i) pages[i] = i;
  const absl::Status sent =
      sender.ok() ? (*sender)->Send("gpu-check-kv", peer, pages, pages, "") : sender.status();
  if (!sent.ok()) std::printf("KV send: %s\n", sent.ToString().c_str());
  sender = absl::CancelledError("done");  // unregisters the pool before it is freed
  for (void* p : buffers) (void)d->FreeDevice(p, device);
  return sent.ok();
}

// One path: WRITEs of the whole buffer, each verified; the best rate.
// Runs in a process that has not used CUDA yet (a child of Main): forks the
// receiver first, as CUDA allows no use across fork().
PathResult RunPath(Mode mode, size_t bytes, int rounds, int src_dev, int dst_dev,
                   double* host_tcp_gbps) {
  int to[2], from[2];
  if (pipe(to) != 0 || pipe(from) != 0) return {};
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    close(to[1]);
    close(from[0]);
    alarm(240);
    Receiver(to[0], from[1], mode, bytes, dst_dev);
  }
  close(to[0]);
  close(from[1]);
  PathResult result;
  const cuda::Driver* d = cuda::Driver::Get();
  if (d == nullptr) return result;
  const std::string hello = ReadLine(from[0]);
  char peer[256];
  unsigned long long remote = 0;  // NOLINT(runtime/int): sscanf's type
  int sink_port = 0;
  auto engine = Engine(mode);
  const DeviceBuffer buffer = Alloc(d, mode, bytes, src_dev);
  void* src = buffer.p;
  std::vector<char> pattern(bytes);
  if (std::sscanf(hello.c_str(), "%255s %llu %d", peer, &remote, &sink_port) == 3 &&
      engine != nullptr && src != nullptr) {
    result.ok = true;
    for (int r = 0; r < rounds && result.ok; ++r) {
      for (size_t i = 0; i < bytes; i += 8)
        pattern[i] = static_cast<char>(i / 8 + r * 31 + static_cast<int>(mode));
      result.ok = d->Copy(src, pattern.data(), bytes, src_dev).ok() &&
                  (r > 0 || engine->RegisterMemory(src, bytes).ok());
      auto seg = engine->OpenSegment(peer);
      if (!result.ok || !seg.ok()) {
        result.ok = false;
        break;
      }
      TransferRequest w{transport::Opcode::kWrite, src, remote, bytes};
      const absl::Time t0 = absl::Now();
      auto batch = engine->Submit(*seg, {&w, 1});
      auto st = batch.ok() ? engine->Wait(*batch, absl::Seconds(120)) : batch.status();
      const double s = absl::ToDoubleSeconds(absl::Now() - t0);
      result.ok = st.ok() && st->ok();
      if (batch.ok()) (void)engine->Release(*batch);
      WriteLine(to[1], "h");
      result.ok = result.ok && std::stoull(ReadLine(from[0])) == Fnv(pattern);
      if (result.ok) result.best_gbps = std::max(result.best_gbps, bytes / s / 1e9);
    }
    if (result.ok) {
      auto seg = engine->OpenSegment(peer);
      result.stream_ok = seg.ok() && StreamOrderedWrite(d, engine.get(), *seg, src, remote, bytes,
                                                        src_dev, &pattern);
      WriteLine(to[1], "h");
      result.stream_ok = std::stoull(ReadLine(from[0])) == Fnv(pattern) && result.stream_ok;
      uint64_t expected = 0;
      if (ChecksummedKv(d, engine.get(), peer, src_dev, &expected)) {
        WriteLine(to[1], "k gpu-check-kv");
        result.kv_ok = ReadLine(from[0]) == "1 " + std::to_string(expected);
      }
    }
    // The host-to-host reference: the same bytes over one TCP connection
    // between the same two processes.
    if (host_tcp_gbps != nullptr && result.ok) {
      for (int r = 0; r < rounds; ++r) {
        WriteLine(to[1], "s");
        const int c = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons(static_cast<uint16_t>(sink_port));
        const absl::Time t0 = absl::Now();
        size_t sent = 0;
        if (connect(c, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
          while (sent < bytes) {
            const ssize_t w = send(c, pattern.data() + sent, bytes - sent, 0);
            if (w <= 0) break;
            sent += static_cast<size_t>(w);
          }
        }
        close(c);
        const bool whole = std::stoull(ReadLine(from[0])) == bytes;
        const double s = absl::ToDoubleSeconds(absl::Now() - t0);
        if (whole) *host_tcp_gbps = std::max(*host_tcp_gbps, bytes / s / 1e9);
      }
    }
  }
  engine.reset();
  Free(d, buffer);
  close(to[1]);
  int status = 0;
  waitpid(child, &status, 0);
  close(from[0]);
  result.ok = result.ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return result;
}

// Runs fn in a child process (CUDA is never used in this one, so every
// child starts it afresh) and returns the numbers it reported; empty when
// it failed.
template <typename Fn>
std::vector<double> InChild(Fn fn) {
  int p[2];
  if (pipe(p) != 0) return {};
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    close(p[0]);
    alarm(280);
    std::vector<double> values;
    const bool ok = fn(&values);
    std::string line = ok ? "ok" : "failed";
    for (double v : values) line += " " + std::to_string(v);
    WriteLine(p[1], line);
    std::fflush(stdout);
    _exit(ok ? 0 : 1);
  }
  close(p[1]);
  const std::string line = ReadLine(p[0]);
  close(p[0]);
  int status = 0;
  waitpid(child, &status, 0);
  if (line.rfind("ok", 0) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return {};
  std::vector<double> out;
  for (size_t at = line.find(' '); at != std::string::npos; at = line.find(' ', at + 1)) {
    out.push_back(std::strtod(line.c_str() + at + 1, nullptr));
  }
  out.insert(out.begin(), 1.0);  // non-empty: it succeeded
  return out;
}

int Main() {
  const size_t bytes = size_t(absl::GetFlag(FLAGS_mib)) << 20;
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  const int src_dev = absl::GetFlag(FLAGS_src_device);
  int dst_dev = absl::GetFlag(FLAGS_dst_device);
  // The driver, the devices and the device-to-device reference.
  const std::vector<double> info = InChild([&](std::vector<double>* out) {
    const cuda::Driver* d = cuda::Driver::Get();
    if (d == nullptr) {
      std::printf("no CUDA driver: %s\n", std::string(cuda::Driver::LoadError().message()).c_str());
      return false;
    }
    const int dst = dst_dev >= 0 ? dst_dev : d->device_count() - 1;
    std::printf("driver %d (%s), %d device(s); %zu MiB from cuda:%d to cuda:%d, %d round(s)\n",
                d->version(), d->library().c_str(), d->device_count(), bytes >> 20, src_dev, dst,
                rounds);
    for (int i = 0; i < d->device_count(); ++i) {
      std::printf("cuda:%d  PCI %s\n", i, d->PciBusId(i).value_or("?").c_str());
    }
    void* a = d->AllocDevice(src_dev, bytes).value_or(nullptr);
    void* b = d->AllocDevice(dst, bytes).value_or(nullptr);
    bool ok = a != nullptr && b != nullptr;
    double best = 0;
    for (int r = 0; r < rounds && ok; ++r) {
      const absl::Time t0 = absl::Now();
      ok = d->Copy(b, a, bytes, dst).ok();
      best = std::max(best, bytes / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9);
    }
    out->push_back(dst);
    out->push_back(best);
    return ok;
  });
  Check(!info.empty(), "the CUDA driver loads; device-to-device cuMemcpy");
  if (info.empty()) {
    std::printf("%d passed, %d failed\n", passed, failed);
    return 1;
  }
  dst_dev = static_cast<int>(info[1]);
  const double d2d = info[2];
  // Each path: its rate, whether its stream-ordered WRITE and its
  // checksummed KV request were verified, and (staging) the host TCP
  // reference.
  struct Path {
    Mode mode;
    const char* what;
    std::vector<double> result;
  };
  std::vector<Path> all = {
      {Mode::kStaged, "device memory between two processes over TCP staging", {}},
      {Mode::kIpc, "device memory between two processes over CUDA IPC", {}},
      {Mode::kVmm, "VMM device memory (20 MiB chunks) between two processes through POSIX fds", {}},
  };
  // The verbs path only where an RDMA engine starts (it says why not).
  const bool rdma =
      !InChild([](std::vector<double>*) { return Engine(Mode::kVerbs) != nullptr; }).empty();
  if (rdma) {
    all.push_back({Mode::kVerbs, "device memory between two processes over RDMA", {}});
  } else {
    std::printf("SKIP device memory over RDMA: no RDMA engine on this host (above)\n");
  }
  for (Path& path : all) {
    path.result = InChild([&](std::vector<double>* out) {
      double host_tcp = 0;
      const PathResult r = RunPath(path.mode, bytes, rounds, src_dev, dst_dev,
                                   path.mode == Mode::kStaged ? &host_tcp : nullptr);
      *out = {r.best_gbps, r.stream_ok ? 1.0 : 0.0, r.kv_ok ? 1.0 : 0.0, host_tcp};
      return r.ok;
    });
    const bool ran = !path.result.empty();
    Check(ran, std::string(path.what) + ", verified");
    Check(
        ran && path.result[2] == 1.0,
        std::string(path.what) + ": a stream-ordered WRITE behind an asynchronous copy, verified");
    Check(ran && path.result[3] == 1.0,
          std::string(path.what) + ": a KV request over device pools with checksums, verified");
  }
  auto rate = [](const Path& p, size_t i) { return p.result.empty() ? 0.0 : p.result[i]; };
  const double staged_rate = rate(all[0], 1);
  const double host_tcp = rate(all[0], 4);
  const double ipc_rate = rate(all[1], 1);
  const double vmm_rate = rate(all[2], 1);
  if (rdma) std::printf("RDMA: %.2f GB/s\n", rate(all[3], 1));
  std::printf(
      "rates (best of %d): TCP staging %.2f GB/s, CUDA IPC %.2f GB/s, VMM fds %.2f GB/s; "
      "references in this run: host-to-host TCP stream %.2f GB/s, device-to-device "
      "cuMemcpy %.2f GB/s\n",
      rounds, staged_rate, ipc_rate, vmm_rate, host_tcp, d2d);
  if (host_tcp > 0) std::printf("TCP staging / host TCP stream: %.2f\n", staged_rate / host_tcp);
  if (d2d > 0) std::printf("CUDA IPC / device-to-device cuMemcpy: %.2f\n", ipc_rate / d2d);
  if (d2d > 0) std::printf("VMM fds / device-to-device cuMemcpy: %.2f\n", vmm_rate / d2d);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "moves GPU memory between two processes over TCP staging, CUDA IPC and VMM "
      "fds; see docs/gpu.md.");
  absl::ParseCommandLine(argc, argv);
  return kvferry::Main();
}
