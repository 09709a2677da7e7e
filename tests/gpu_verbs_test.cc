// GPU memory over real verbs: inside tools/softroce/vm.sh (rxe0), skipped
// where there is no RDMA port.
//
// The peermem path: the fake driver in KVFERRY_FAKE_CUDA_PEERMEM mode maps
// its "device" memory so that the kernel can pin it, as nvidia-peermem lets
// ibv_reg_mr pin GPU memory. Each engine registers its device memory with
// the verbs transport (plain ibv_reg_mr: the fake has no dma-buf export),
// then takes the CPU's access away again (kvferry_fake_cuda_hide): the bytes
// move NIC to NIC only. A decode process and a prefill process: the prefill
// WRITEs its device memory to the decode's over RDMA, the decode checks
// every byte through the driver and reports a hash, then the prefill READs
// it back into device memory of its own and checks it.
// (The dma-buf path: transport/verbs/verbs_device_memory_test.cc.)
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/testing/fake_driver.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "tools/gpu/two_process.h"
#include "transport/verbs/test_ports.h"

namespace kvferry {
namespace {

using gpu::Fnv;
using gpu::ReadLine;
using gpu::WriteLine;
using transport::Opcode;

constexpr size_t kBytes = (4 << 20) + 8192;

int FakeHide() {
  void* lib = ::dlopen(std::getenv("KVFERRY_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  auto hide = lib == nullptr ? nullptr : reinterpret_cast<int (*)()>(::dlsym(lib, "kvferry_fake_cuda_hide"));
  return hide == nullptr ? -1 : hide();
}

std::unique_ptr<TransferEngine> RdmaEngine() {
  EngineOptions o;
  o.local_host = "127.0.0.1";
  o.transport = "rdma";  // no TCP beside it: a fall back would prove nothing
  auto e = TransferEngine::Create(o);
  return e.ok() ? std::move(*e) : nullptr;
}

[[noreturn]] void Decode(int in, int out) {
  setenv("KVFERRY_FAKE_CUDA_PEERMEM", "1", 1);
  const cuda::Driver* d = cuda::UseFakeDriver();
  auto engine = d != nullptr ? RdmaEngine() : nullptr;
  void* dst = engine != nullptr ? d->AllocDevice(1, kBytes).value_or(nullptr) : nullptr;
  if (dst == nullptr) _exit(2);
  const absl::Status reg = engine->RegisterMemory(dst, kBytes, transport::Access::kRemoteReadWrite);
  if (!reg.ok() || FakeHide() != 0) {
    WriteLine(out, "register failed: " + reg.ToString());
    _exit(3);
  }
  WriteLine(out, engine->address() + " " + std::to_string(reinterpret_cast<uintptr_t>(dst)));
  char cmd;
  while (read(in, &cmd, 1) == 1 && cmd == 'h') {
    std::vector<char> bytes(kBytes);
    if (!d->Copy(bytes.data(), dst, kBytes, 1).ok()) _exit(4);
    WriteLine(out, std::to_string(Fnv(bytes)));
  }
  engine.reset();
  _exit(0);
}

std::string Prefill(int to_decode, int from_decode) {
  setenv("KVFERRY_FAKE_CUDA_PEERMEM", "1", 1);
  const cuda::Driver* d = cuda::UseFakeDriver();
  if (d == nullptr) return "no fake driver";
  const std::string hello = ReadLine(from_decode);
  const size_t space = hello.find(' ');
  if (space == std::string::npos) return "decode process failed: '" + hello + "'";
  const std::string peer = hello.substr(0, space);
  const uintptr_t remote = std::stoull(hello.substr(space + 1));
  auto engine = RdmaEngine();
  if (engine == nullptr) return "no RDMA engine";
  void* src = d->AllocDevice(0, kBytes).value_or(nullptr);
  void* back = d->AllocDevice(0, kBytes).value_or(nullptr);
  if (src == nullptr || back == nullptr) return "no device memory";
  std::vector<char> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<char>(i * 151 + (i >> 11));
  if (!d->Copy(src, pattern.data(), kBytes, 0).ok()) return "fill failed";
  for (void* p : {src, back}) {
    const absl::Status reg = engine->RegisterMemory(p, kBytes, transport::Access::kNone);
    if (!reg.ok()) return "register: " + reg.ToString();
  }
  if (FakeHide() != 0) return "cannot hide the arena";
  auto seg = engine->OpenSegment(peer);
  if (!seg.ok()) return seg.status().ToString();
  auto run = [&](Opcode op, void* local) -> std::string {
    // Scattered 64 KiB pages, as a KV layer sends them.
    std::vector<TransferRequest> reqs;
    for (size_t off = 0; off < kBytes; off += 64 << 10) {
      const uint64_t n = std::min<uint64_t>(64 << 10, kBytes - off);
      reqs.push_back({op, static_cast<char*>(local) + off, remote + off, n});
    }
    auto batch = engine->Submit(*seg, reqs);
    if (!batch.ok()) return batch.status().ToString();
    auto st = engine->Wait(*batch, absl::Seconds(60));
    if (!st.ok()) return st.status().ToString();
    if (!st->ok()) return st->requests[0].ToString();
    return "";
  };
  if (std::string e = run(Opcode::kWrite, src); !e.empty()) return "WRITE: " + e;
  const EngineMetrics m = engine->GetMetrics();
  if (m.peers.size() != 1 || m.peers[0].transport != "verbs") {
    return "the peer is not on verbs: " + (m.peers.empty() ? std::string("none") : m.peers[0].transport);
  }
  if (write(to_decode, "h", 1) != 1) return "decode gone";
  if (ReadLine(from_decode) != std::to_string(Fnv(pattern))) return "the decode's bytes differ";
  if (std::string e = run(Opcode::kRead, back); !e.empty()) return "READ: " + e;
  std::vector<char> got(kBytes);
  if (!d->Copy(got.data(), back, kBytes, 0).ok()) return "copy back failed";
  if (got != pattern) return "the READ brought different bytes";
  return "";
}

TEST(GpuVerbsTest, DeviceMemoryMovesNicToNicThroughPeermemRegistration) {
  transport::verbs::TestPorts ports;
  if (!ports.SkipReason().empty()) GTEST_SKIP() << ports.SkipReason();
  // Both ends are children: each loads the driver afresh.
  int to_decode[2], from_decode[2], result[2];
  ASSERT_EQ(pipe(to_decode), 0);
  ASSERT_EQ(pipe(from_decode), 0);
  ASSERT_EQ(pipe(result), 0);
  const pid_t decode = fork();
  ASSERT_GE(decode, 0);
  if (decode == 0) {
    for (int fd : {to_decode[1], from_decode[0], result[0], result[1]}) close(fd);
    alarm(240);
    Decode(to_decode[0], from_decode[1]);
  }
  const pid_t prefill = fork();
  ASSERT_GE(prefill, 0);
  if (prefill == 0) {
    for (int fd : {to_decode[0], from_decode[1], result[0]}) close(fd);
    alarm(240);
    WriteLine(result[1], Prefill(to_decode[1], from_decode[0]));
    _exit(0);
  }
  for (int fd : {to_decode[0], from_decode[0], from_decode[1], result[1]}) close(fd);
  EXPECT_EQ(ReadLine(result[0]), "");
  close(result[0]);
  close(to_decode[1]);
  for (pid_t p : {prefill, decode}) {
    int status = 0;
    ASSERT_EQ(waitpid(p, &status, 0), p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
}

}  // namespace
}  // namespace kvferry
