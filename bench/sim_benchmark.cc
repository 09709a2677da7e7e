// How fast the simulator itself runs: wall-clock cost of moving bytes with
// SimTransport over the simulated fabric, next to memcpy of the same bytes
// measured in the same run (the floor: every simulated byte is copied into
// a message and out again). Sweep sizes depend on this ratio.
//
//   ./bazelw run -c opt //bench:sim_benchmark
#include <cstring>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "sim/fabric.h"
#include "sim/scheduler.h"
#include "transport/in_process.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {
namespace {

void BM_Memcpy(benchmark::State& state) {
  const size_t n = state.range(0);
  std::vector<char> src(n, 'x'), dst(n);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * n);
}
BENCHMARK(BM_Memcpy)->Arg(4096)->Arg(64 << 10)->Arg(1 << 20);

void BM_SimTransportWrite(benchmark::State& state) {
  const size_t n = state.range(0);
  sim::Scheduler sched;
  sim::Fabric fabric(&sched, 1);
  std::unique_ptr<transport::SimTransport> t[2];
  for (int i = 0; i < 2; ++i) {
    transport::SimTransportOptions o;
    o.nics = {*fabric.topology().AddNic(fabric.topology().AddNode("n"), {})};
    t[i] = *transport::SimTransport::Create(&fabric, o, i + 1);
  }
  auto links = *transport::ConnectInProcess(*t[0], *t[1]);
  std::vector<char> src(n, 'x'), dst(n);
  auto rs = *t[0]->RegisterMemory(src.data(), n, transport::Access::kNone);
  auto rd = *t[1]->RegisterMemory(dst.data(), n, transport::Access::kRemoteWrite);
  transport::WorkRequest wr;
  wr.link = links.first;
  wr.local_region = rs.id;
  wr.local_addr = src.data();
  wr.length = n;
  wr.remote_addr = rd.addr;
  wr.remote_key = rd.keys[0];
  transport::Completion c;
  for (auto _ : state) {
    if (!t[0]->Post({&wr, 1}).ok() || t[0]->WaitCompletions({&c, 1}, absl::Seconds(1)) != 1 ||
        !c.status.ok()) {
      state.SkipWithError("simulated write failed");
      break;
    }
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * n);
  state.counters["events_per_op"] =
      benchmark::Counter(double(sched.events_run()) / std::max<int64_t>(1, state.iterations()));
}
BENCHMARK(BM_SimTransportWrite)->Arg(4096)->Arg(64 << 10)->Arg(1 << 20);

}  // namespace
}  // namespace kvferry

BENCHMARK_MAIN();
