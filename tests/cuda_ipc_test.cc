// Device memory between two processes on one host, through the fake CUDA
// driver (//cuda/testing; its device memory is a shared-memory file that
// another process maps, and PROT_NONE to the CPU): with CUDA IPC the
// responder maps the requester's allocation and the GPUs copy, nothing but
// the request crosses the socket; with IPC off (or a handle that cannot be
// opened) the bytes are staged over TCP. Either way every byte arrives.
// VMM memory (PyTorch's expandable segments: chunks of their own allocation
// mapped back to back) has no IPC handle: the responder fetches its chunks
// as fds from the requester's VMM server and maps them.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "tools/gpu/two_process.h"

namespace kvferry {
namespace {

using transport::Opcode;

constexpr size_t kBytes = (4 << 20) + 12288;

using gpu::Fnv;
using gpu::ReadLine;
using gpu::WriteLine;

// kVmmUnshareable: VMM memory made without a shareable handle type (PyTorch
// with TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0) goes staged.
enum class Path { kCudaIpc, kVmm, kVmmUnshareable, kStaging };

std::unique_ptr<TransferEngine> Engine(Path path) {
  return gpu::LoopbackEngine(path != Path::kStaging);
}

// A counter of the fake driver's (not a driver entry point).
uint64_t FakeCount(const char* name) {
  // The fake driver is loaded already (RTLD_NOLOAD: no second copy).
  void* lib = ::dlopen(std::getenv("KVFERRY_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  auto count = lib == nullptr ? nullptr : reinterpret_cast<uint64_t (*)()>(::dlsym(lib, name));
  return count == nullptr ? ~uint64_t{0} : count();
}

// Device memory for kBytes: VMM memory starts 12 KiB into its first 2 MiB
// chunk and so spans three.
void* Alloc(const cuda::Driver* d, int device, Path path) {
  if (path != Path::kVmm && path != Path::kVmmUnshareable) {
    return d->AllocDevice(device, kBytes).value_or(nullptr);
  }
  const uint64_t chunk = d->VmmGranularity(device).value_or(0);
  if (chunk == 0 || 3 * chunk < kBytes + 12288) return nullptr;
  void* base = d->AllocVmm(device, chunk, 3).value_or(nullptr);
  return base == nullptr ? nullptr : static_cast<char*>(base) + 12288;
}

// The decode process: device memory on GPU 1, registered; reports its engine
// and buffer, then on each request the hash of its buffer and how many IPC
// handles it opened and VMM allocations it imported.
[[noreturn]] void Decode(int in, int out, Path path) {
  const cuda::Driver* d = cuda::UseFakeDriver();
  auto engine = d != nullptr ? Engine(path) : nullptr;
  void* dst = engine != nullptr ? Alloc(d, 1, path) : nullptr;
  if (dst == nullptr ||
      !engine->RegisterMemory(dst, kBytes, transport::Access::kRemoteReadWrite).ok()) {
    _exit(2);
  }
  const std::string hello = engine->address() + " " + std::to_string(reinterpret_cast<uintptr_t>(dst)) + "\n";
  if (write(out, hello.data(), hello.size()) < 0) _exit(3);
  char cmd;
  while (read(in, &cmd, 1) == 1 && (cmd == 'h' || cmd == 'f')) {
    if (cmd == 'f') {
      // Fence the prefill instance named on the line; report what of other
      // processes' memory is still mapped here.
      const uint64_t id = std::stoull(ReadLine(in));
      engine->FencePeer(id);
      const std::string answer = std::to_string(FakeCount("kvferry_fake_cuda_live_imports")) + "\n";
      if (write(out, answer.data(), answer.size()) < 0) _exit(5);
      continue;
    }
    std::vector<char> bytes(kBytes);
    if (!d->Copy(bytes.data(), dst, kBytes, 1).ok()) _exit(4);
    const std::string answer = std::to_string(Fnv(bytes)) + " " +
                               std::to_string(FakeCount("kvferry_fake_cuda_ipc_opens")) + " " +
                               std::to_string(FakeCount("kvferry_fake_cuda_vmm_imports")) + " " +
                               std::to_string(FakeCount("kvferry_fake_cuda_live_imports")) + "\n";
    if (write(out, answer.data(), answer.size()) < 0) _exit(5);
  }
  engine.reset();  // its threads end before the process does
  _exit(0);
}


// The prefill process: device memory on GPU 0; WRITEs it whole to the
// decode process, checks the decode's hash and IPC count, READs it back.
// Returns "" or what went wrong.
std::string Prefill(Path path, int to_decode, int from_decode) {
  const int ipc = static_cast<int>(path);
  if (path == Path::kVmmUnshareable) setenv("KVFERRY_FAKE_CUDA_VMM_NO_EXPORT", "1", 1);
  const cuda::Driver* d = cuda::UseFakeDriver();
  if (d == nullptr) return "no fake driver";
  const std::string hello = ReadLine(from_decode);
  const size_t space = hello.find(' ');
  if (space == std::string::npos) return "decode process failed: '" + hello + "'";
  const std::string peer = hello.substr(0, space);
  const uintptr_t remote = std::stoull(hello.substr(space + 1));
  auto engine = Engine(path);
  if (engine == nullptr) return "no engine";
  void* const src = Alloc(d, 0, path);
  void* const back = Alloc(d, 1, path);
  if (src == nullptr || back == nullptr) return "no device memory";
  std::vector<char> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<char>(i * 131 + (i >> 12) + ipc);
  if (!d->Copy(src, pattern.data(), kBytes, 0).ok()) return "fill failed";
  if (!engine->RegisterMemory(src, kBytes).ok() ||
      !engine->RegisterMemory(back, kBytes, transport::Access::kNone).ok()) {
    return "register failed";
  }
  auto seg = engine->OpenSegment(peer);
  if (!seg.ok()) return seg.status().ToString();
  auto run = [&](Opcode op, void* local) -> std::string {
    TransferRequest req{op, local, remote, kBytes};
    auto batch = engine->Submit(*seg, {&req, 1});
    if (!batch.ok()) return batch.status().ToString();
    auto st = engine->Wait(*batch, absl::Seconds(30));
    if (!st.ok()) return st.status().ToString();
    return st->ok() ? "" : st->requests[0].ToString();
  };
  if (std::string e = run(Opcode::kWrite, src); !e.empty()) return "WRITE: " + e;
  if (write(to_decode, "h", 1) != 1) return "decode gone";
  const std::string report = ReadLine(from_decode);
  const size_t sp = report.find(' ');
  if (sp == std::string::npos) return "no report from decode: '" + report + "'";
  if (std::stoull(report.substr(0, sp)) != Fnv(pattern)) return "the decode's bytes differ";
  uint64_t opens = 0, imports = 0, live = 0;
  if (std::sscanf(report.c_str() + sp + 1, "%lu %lu %lu", &opens, &imports, &live) != 3) {
    return "a bad report from decode: '" + report + "'";
  }
  if (path == Path::kCudaIpc && (opens == 0 || imports != 0)) {
    return "the decode process opened " + std::to_string(opens) + " IPC handles and imported " +
           std::to_string(imports) + " VMM allocations";
  }
  // The three chunks, once per link at most.
  if (path == Path::kVmm && (opens != 0 || imports < 3 || imports % 3 != 0)) {
    return "VMM memory: the decode process opened " + std::to_string(opens) +
           " IPC handles and imported " + std::to_string(imports) + " VMM allocations";
  }
  if ((path == Path::kStaging || path == Path::kVmmUnshareable) && (opens != 0 || imports != 0)) {
    return "IPC used although off or impossible";
  }
  // Back into fresh device memory: the decode copies into this process's
  // allocation (IPC), or sends the bytes.
  if (std::string e = run(Opcode::kRead, back); !e.empty()) return "READ: " + e;
  std::vector<char> got(kBytes);
  if (!d->Copy(got.data(), back, kBytes, 1).ok()) return "copy back failed";
  if (got != pattern) return "the READ brought different bytes";
  if ((path == Path::kCudaIpc || path == Path::kVmm) && live == 0) {
    return "the decode process holds no mapping of this process's memory after a WRITE";
  }
  // Fenced: the decode drops every mapping of this process's memory, and
  // a later WRITE (new bytes) is refused and lands nothing.
  WriteLine(to_decode, "f" + std::to_string(engine->engine_id()));
  const std::string mapped = ReadLine(from_decode);
  if (mapped != "0") return "after the fence the decode still maps " + mapped + " allocations";
  std::vector<char> other(kBytes);
  for (size_t i = 0; i < kBytes; ++i) other[i] = static_cast<char>(~pattern[i]);
  if (!d->Copy(src, other.data(), kBytes, 0).ok()) return "refill failed";
  if (run(Opcode::kWrite, src).empty()) return "a fenced prefill's WRITE succeeded";
  if (write(to_decode, "h", 1) != 1) return "decode gone";
  const std::string after = ReadLine(from_decode);
  if (after.substr(0, after.find(' ')) != std::to_string(Fnv(pattern))) {
    return "a fenced prefill's WRITE changed the decode's bytes";
  }
  return "";
}

class CudaIpcTest : public ::testing::TestWithParam<Path> {};

TEST_P(CudaIpcTest, DeviceMemoryCrossesProcessesWhole) {
  // Both ends are child processes: this one never loads the driver, so each
  // case starts from a fresh one.
  int to_decode[2], from_decode[2], result[2];
  ASSERT_EQ(pipe(to_decode), 0);
  ASSERT_EQ(pipe(from_decode), 0);
  ASSERT_EQ(pipe(result), 0);
  const pid_t decode = fork();
  ASSERT_GE(decode, 0);
  if (decode == 0) {
    for (int fd : {to_decode[1], from_decode[0], result[0], result[1]}) close(fd);
    alarm(60);  // a hang ends the child, and its pipes with it
    Decode(to_decode[0], from_decode[1], GetParam());
  }
  const pid_t prefill = fork();
  ASSERT_GE(prefill, 0);
  if (prefill == 0) {
    for (int fd : {to_decode[0], from_decode[1], result[0]}) close(fd);
    alarm(60);
    const std::string e = Prefill(GetParam(), to_decode[1], from_decode[0]) + "\n";
    _exit(write(result[1], e.data(), e.size()) > 0 ? 0 : 1);
  }
  for (int fd : {to_decode[0], from_decode[0], from_decode[1], result[1]}) close(fd);
  EXPECT_EQ(ReadLine(result[0]), "");
  close(result[0]);
  close(to_decode[1]);  // the decode process ends
  for (pid_t p : {prefill, decode}) {
    int status = 0;
    ASSERT_EQ(waitpid(p, &status, 0), p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CudaIpcTest,
                         ::testing::Values(Path::kCudaIpc, Path::kVmm, Path::kVmmUnshareable,
                                           Path::kStaging),
                         [](const ::testing::TestParamInfo<Path>& info) {
                           switch (info.param) {
                             case Path::kCudaIpc: return std::string("cuda_ipc");
                             case Path::kVmm: return std::string("vmm_fds");
                             case Path::kVmmUnshareable: return std::string("vmm_unshareable");
                             default: return std::string("tcp_staging");
                           }
                         });

}  // namespace
}  // namespace kvferry
