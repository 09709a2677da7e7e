// Device memory between two processes on one host, through the fake CUDA
// driver (//cuda/testing; its device memory is a shared-memory file that
// another process maps, and PROT_NONE to the CPU): with CUDA IPC the
// responder maps the requester's allocation and the GPUs copy, nothing but
// the request crosses the socket; with IPC off (or a handle that cannot be
// opened) the bytes are staged over TCP. Either way every byte arrives.
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

std::unique_ptr<TransferEngine> Engine(bool cuda_ipc) { return gpu::LoopbackEngine(cuda_ipc); }

uint64_t IpcOpens() {
  // The fake driver is loaded already (RTLD_NOLOAD: no second copy).
  void* lib = ::dlopen(std::getenv("KVFERRY_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  auto opens = lib == nullptr ? nullptr
                              : reinterpret_cast<uint64_t (*)()>(
                                    ::dlsym(lib, "kvferry_fake_cuda_ipc_opens"));
  return opens == nullptr ? ~uint64_t{0} : opens();
}

// The decode process: device memory on GPU 1, registered; reports its engine
// and buffer, then on each request the hash of its buffer and how many IPC
// handles it opened.
[[noreturn]] void Decode(int in, int out, bool cuda_ipc) {
  const cuda::Driver* d = cuda::UseFakeDriver();
  auto engine = d != nullptr ? Engine(cuda_ipc) : nullptr;
  void* dst = engine != nullptr ? d->AllocDevice(1, kBytes).value_or(nullptr) : nullptr;
  if (dst == nullptr ||
      !engine->RegisterMemory(dst, kBytes, transport::Access::kRemoteReadWrite).ok()) {
    _exit(2);
  }
  const std::string hello = engine->address() + " " + std::to_string(reinterpret_cast<uintptr_t>(dst)) + "\n";
  if (write(out, hello.data(), hello.size()) < 0) _exit(3);
  char cmd;
  while (read(in, &cmd, 1) == 1 && cmd == 'h') {
    std::vector<char> bytes(kBytes);
    if (!d->Copy(bytes.data(), dst, kBytes, 1).ok()) _exit(4);
    const std::string answer = std::to_string(Fnv(bytes)) + " " + std::to_string(IpcOpens()) + "\n";
    if (write(out, answer.data(), answer.size()) < 0) _exit(5);
  }
  engine.reset();  // its threads end before the process does
  _exit(0);
}


// The prefill process: device memory on GPU 0; WRITEs it whole to the
// decode process, checks the decode's hash and IPC count, READs it back.
// Returns "" or what went wrong.
std::string Prefill(bool ipc, int to_decode, int from_decode) {
  const cuda::Driver* d = cuda::UseFakeDriver();
  if (d == nullptr) return "no fake driver";
  const std::string hello = ReadLine(from_decode);
  const size_t space = hello.find(' ');
  if (space == std::string::npos) return "decode process failed: '" + hello + "'";
  const std::string peer = hello.substr(0, space);
  const uintptr_t remote = std::stoull(hello.substr(space + 1));
  auto engine = Engine(ipc);
  if (engine == nullptr) return "no engine";
  auto src = d->AllocDevice(0, kBytes);
  auto back = d->AllocDevice(1, kBytes);
  if (!src.ok() || !back.ok()) return "no device memory";
  std::vector<char> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<char>(i * 131 + (i >> 12) + ipc);
  if (!d->Copy(*src, pattern.data(), kBytes, 0).ok()) return "fill failed";
  if (!engine->RegisterMemory(*src, kBytes).ok() ||
      !engine->RegisterMemory(*back, kBytes, transport::Access::kNone).ok()) {
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
  if (std::string e = run(Opcode::kWrite, *src); !e.empty()) return "WRITE: " + e;
  if (write(to_decode, "h", 1) != 1) return "decode gone";
  const std::string report = ReadLine(from_decode);
  const size_t sp = report.find(' ');
  if (sp == std::string::npos) return "no report from decode: '" + report + "'";
  if (std::stoull(report.substr(0, sp)) != Fnv(pattern)) return "the decode's bytes differ";
  const uint64_t opens = std::stoull(report.substr(sp + 1));
  if (ipc && opens == 0) return "the decode process never opened an IPC handle";
  if (!ipc && opens != 0) return "IPC used although off";
  // Back into fresh device memory: the decode copies into this process's
  // allocation (IPC), or sends the bytes.
  if (std::string e = run(Opcode::kRead, *back); !e.empty()) return "READ: " + e;
  std::vector<char> got(kBytes);
  if (!d->Copy(got.data(), *back, kBytes, 1).ok()) return "copy back failed";
  if (got != pattern) return "the READ brought different bytes";
  return "";
}

class CudaIpcTest : public ::testing::TestWithParam<bool> {};

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

INSTANTIATE_TEST_SUITE_P(Paths, CudaIpcTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "cuda_ipc" : "tcp_staging");
                         });

}  // namespace
}  // namespace kvferry
