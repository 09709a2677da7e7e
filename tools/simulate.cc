// kvferry simulate: moves data between two simulated hosts over the
// deterministic fabric and the sim transport, verifies every byte, and
// reports the rate in simulated time against the link's limit.
//
//   ./bazelw run //tools:simulate -- --seed=7 --drop=1/200 --bytes=64MiB
//
// The same flags and seed always print the same numbers and trace hash.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "sim/fabric.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "transport/in_process.h"
#include "transport/sim/sim_transport.h"

ABSL_FLAG(uint64_t, seed, 1, "root seed of the simulation");
ABSL_FLAG(uint64_t, bytes, 64 << 20, "bytes to move in total");
ABSL_FLAG(uint64_t, block, 1 << 20, "bytes per request");
ABSL_FLAG(uint32_t, depth, 16, "requests kept in flight");
ABSL_FLAG(std::string, op, "write", "write or read");
ABSL_FLAG(double, gbps, 100, "NIC rate in Gb/s");
ABSL_FLAG(absl::Duration, latency, absl::Microseconds(1),
          "one-way latency of each NIC to the switch");
ABSL_FLAG(uint32_t, mtu, 4096, "NIC MTU in bytes");
ABSL_FLAG(std::string, drop, "0/1", "per-packet drop probability, as N/D");
ABSL_FLAG(std::string, delay, "0/1", "probability that a message is delayed, as N/D");
ABSL_FLAG(absl::Duration, max_delay, absl::Microseconds(20),
          "largest extra delay of a delayed message");

namespace kvferry {
namespace {

bool ParseRatio(absl::string_view text, sim::Ratio* out) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, '/');
  return parts.size() == 2 && absl::SimpleAtoi(parts[0], &out->num) &&
         absl::SimpleAtoi(parts[1], &out->den) && out->den > 0 && out->num <= out->den;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "simulate: %s\n", message.c_str());
  return 2;
}

int Run() {
  using transport::Opcode;
  sim::FaultOptions faults;
  if (!ParseRatio(absl::GetFlag(FLAGS_drop), &faults.drop)) {
    return Fail("--drop must be N/D with 0 <= N <= D, e.g. 1/100");
  }
  if (!ParseRatio(absl::GetFlag(FLAGS_delay), &faults.delay)) {
    return Fail("--delay must be N/D with 0 <= N <= D, e.g. 1/10");
  }
  faults.max_delay = absl::GetFlag(FLAGS_max_delay);
  const std::string op_name = absl::GetFlag(FLAGS_op);
  if (op_name != "write" && op_name != "read") return Fail("--op must be write or read");
  const Opcode op = op_name == "write" ? Opcode::kWrite : Opcode::kRead;
  const uint64_t block = absl::GetFlag(FLAGS_block);
  const uint64_t total = absl::GetFlag(FLAGS_bytes);
  const uint32_t depth = absl::GetFlag(FLAGS_depth);
  if (block == 0 || total < block) return Fail("need 0 < --block <= --bytes");
  if (depth == 0 || depth > 1024) return Fail("--depth must be in 1..1024");
  const double gbps = absl::GetFlag(FLAGS_gbps);
  if (!(gbps > 0)) return Fail("--gbps must be positive");

  sim::Prng root(absl::GetFlag(FLAGS_seed));
  sim::Scheduler sched;
  sim::Fabric fabric(&sched, root.Next64(), faults);
  sim::NicSpec spec{static_cast<uint64_t>(gbps * 1e9), absl::GetFlag(FLAGS_latency),
                    absl::GetFlag(FLAGS_mtu)};
  std::unique_ptr<transport::SimTransport> hosts[2];
  for (auto& host : hosts) {
    absl::StatusOr<sim::NicId> nic = fabric.topology().AddNic(
        fabric.topology().AddNode(&host == &hosts[0] ? "prefill" : "decode"), spec);
    if (!nic.ok()) return Fail(std::string(nic.status().message()));
    transport::SimTransportOptions options;
    options.nics = {*nic};
    auto t = transport::SimTransport::Create(&fabric, options, root.Next64());
    if (!t.ok()) return Fail(std::string(t.status().message()));
    host = std::move(*t);
  }
  const uint64_t blocks = total / block;
  std::vector<char> src(blocks * block), dst(blocks * block, 0);
  sim::Prng fill(root.Next64());
  for (size_t i = 0; i < src.size(); i += 8) {
    const uint64_t w = fill.Next64();
    std::memcpy(&src[i], &w, std::min<size_t>(8, src.size() - i));
  }
  // WRITE: local src -> remote dst. READ: local dst <- remote src.
  auto local = hosts[0]->RegisterMemory(op == Opcode::kWrite ? src.data() : dst.data(), src.size(),
                                        transport::Access::kNone);
  auto remote = hosts[1]->RegisterMemory(op == Opcode::kWrite ? dst.data() : src.data(), src.size(),
                                         transport::Access::kRemoteReadWrite);
  if (!local.ok() || !remote.ok()) return Fail("registration failed");
  auto links = transport::ConnectInProcess(*hosts[0], *hosts[1]);
  if (!links.ok()) return Fail(std::string(links.status().message()));
  uint64_t posted = 0, done = 0, failed = 0;
  auto post = [&]() {
    transport::WorkRequest wr;
    wr.opcode = op;
    wr.link = links->first;
    wr.local_region = local->id;
    wr.local_addr = reinterpret_cast<void*>(local->addr + posted * block);
    wr.length = block;
    wr.remote_addr = remote->addr + posted * block;
    wr.remote_key = remote->keys[0];
    wr.cookie = posted++;
    return hosts[0]->Post({&wr, 1});
  };
  const sim::SimTime start = sched.now();
  while (posted < blocks && posted < depth) {
    if (!post().ok()) return Fail("post failed");
  }
  transport::Completion c[64];
  while (done < blocks) {
    size_t n = hosts[0]->WaitCompletions(absl::MakeSpan(c), absl::Seconds(10));
    if (n == 0) return Fail("no completion within 10 s of simulated time");
    for (size_t i = 0; i < n; ++i) {
      ++done;
      if (!c[i].status.ok()) {
        ++failed;
        std::fprintf(stderr, "request %llu failed: %s\n",
                     static_cast<unsigned long long>(c[i].cookie),
                     std::string(c[i].status.message()).c_str());
      }
      if (posted < blocks && failed == 0 && !post().ok()) return Fail("post failed");
    }
    if (failed) break;
  }
  const double seconds = (sched.now() - start) / 1e9;
  const double gbytes = static_cast<double>(done * block) / 1e9;
  const bool verified = failed == 0 && src == dst;
  std::printf("kvferry simulate: %s %llu x %llu B over one %.0f Gb/s link (seed %llu)\n",
              op_name.c_str(), static_cast<unsigned long long>(blocks),
              static_cast<unsigned long long>(block), gbps,
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_seed)));
  std::printf("  simulated time   %.3f ms\n", seconds * 1e3);
  std::printf("  goodput          %.2f GB/s (%.1f%% of the %.2f GB/s link)\n", gbytes / seconds,
              100 * gbytes / seconds / (gbps / 8), gbps / 8);
  std::printf("  fabric messages  %llu sent, %llu dropped\n",
              static_cast<unsigned long long>(fabric.stats().sent),
              static_cast<unsigned long long>(fabric.stats().dropped));
  std::printf("  events           %llu, trace hash %016llx\n",
              static_cast<unsigned long long>(sched.events_run()),
              static_cast<unsigned long long>(sched.trace_hash()));
  std::printf("  bytes verified   %s\n", verified ? "yes" : "NO");
  return verified ? 0 : 1;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "moves data between two simulated hosts and verifies it.\n"
      "  ./bazelw run //tools:simulate -- --seed=7 --drop=1/200");
  absl::ParseCommandLine(argc, argv);
  return kvferry::Run();
}
