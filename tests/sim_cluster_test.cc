// A whole simulated cluster under a seeded fault schedule: four hosts with
// two NICs each send WRITEs and READs to one another while partitions, NIC
// outages, crashes with restarts (new keys), drops, delays and error
// completions happen; then the fabric heals. Checked on every seed:
//   * every request of a live transport completes, within a bound;
//   * no request reports success unless its bytes are in place;
//   * after the heal, every new request succeeds (nothing stays broken).
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "sim/fabric.h"
#include "sim/fault_injector.h"
#include "sim/prng.h"
#include "sim/scheduler.h"
#include "sim/seed.h"
#include "transport/in_process.h"
#include "transport/sim/sim_transport.h"

namespace kvferry {
namespace {

using sim::NodeId;
using sim::SimTime;
using transport::Completion;
using transport::LinkId;
using transport::Opcode;
using transport::WorkRequest;

constexpr int kNodes = 4;
constexpr size_t kSlot = 8 << 10;  // one slot per (sender, receiver) pair
// Each host's memory: [0, kHalf) receives (WRITE targets, READ destinations),
// [kHalf, 2 kHalf) is only ever read (WRITE and READ sources), so a source
// never changes and a successful request can be checked byte for byte.
constexpr size_t kHalf = kSlot * kNodes * kNodes;

class Cluster {
 public:
  explicit Cluster(uint64_t seed)
      : root_(seed), fabric_(&sched_, root_.Next64(), MessageFaults()), traffic_(root_.Next64()) {
    for (int n = 0; n < kNodes; ++n) {
      NodeId node = fabric_.topology().AddNode("host" + std::to_string(n));
      std::vector<sim::NicId> nics;
      for (int i = 0; i < 2; ++i) nics.push_back(*fabric_.topology().AddNic(node, {}));
      nics_.push_back(nics);
      mem_.emplace_back(kSlot * kNodes * kNodes * 2);
      sim::Prng fill(seed * 100 + n);
      for (char& c : mem_.back()) c = static_cast<char>(fill.Next64());
      hosts_.emplace_back();
      Boot(n);
    }
  }

  static sim::FaultOptions MessageFaults() {
    sim::FaultOptions f;
    f.drop = {1, 100};
    f.delay = {1, 10};
    f.max_delay = absl::Microseconds(50);
    f.error_completion = {1, 50};
    return f;
  }

  void Boot(int n) {
    transport::SimTransportOptions o;
    o.nics = nics_[n];
    o.ack_timeout = absl::Microseconds(200);
    hosts_[n].t = *transport::SimTransport::Create(&fabric_, o, root_.Next64());
    hosts_[n].region = *hosts_[n].t->RegisterMemory(mem_[n].data(), mem_[n].size(),
                                                    transport::Access::kRemoteReadWrite);
    hosts_[n].links.clear();
    hosts_[n].outstanding.clear();
  }
  void Crash(int n) {
    hosts_[n].t.reset();  // the process dies with its in-flight requests
    hosts_[n].outstanding.clear();
    hosts_[n].links.clear();
  }

  // Posts one request from `from` to `to`, connecting on demand. Returns
  // false when either side is down.
  bool Send(int from, int to, Opcode op, bool verify) {
    Host& h = hosts_[from];
    if (!h.t || !hosts_[to].t || from == to) return false;
    const transport::NicIndex nic = traffic_.Uniform(2);
    const uint64_t key = uint64_t(to) * 2 + nic;
    auto link = h.links.find(key);
    if (link == h.links.end()) {
      // The handshake's job; done directly here.
      auto links = transport::ConnectInProcess(*h.t, *hosts_[to].t, nic, nic);
      EXPECT_TRUE(links.ok()) << links.status();
      if (!links.ok()) return false;
      link = h.links.emplace(key, links->first).first;
    }
    // The sender's slot at the receiver (WRITE) or the receiver's slot at
    // the sender (READ); one request per pair in flight when verifying.
    const size_t slot = (size_t(from) * kNodes + to) * kSlot;
    const size_t len = 1 + traffic_.Uniform(kSlot - 1);
    WorkRequest wr;
    wr.opcode = op;
    wr.link = link->second;
    wr.local_region = h.region.id;
    wr.local_addr = mem_[from].data() + slot + (op == Opcode::kWrite ? kHalf : 0);
    wr.length = len;
    wr.remote_addr = hosts_[to].region.addr + slot + (op == Opcode::kRead ? kHalf : 0);
    wr.remote_key = hosts_[to].region.keys[nic];
    wr.cookie = next_cookie_++;
    absl::Status posted = h.t->Post({&wr, 1});
    if (!posted.ok()) {
      // A link already in the error state: drop it and retry next time.
      EXPECT_EQ(posted.code(), absl::StatusCode::kFailedPrecondition) << posted;
      h.links.erase(link);
      return false;
    }
    h.outstanding[wr.cookie] = {wr, to, verify, sched_.now()};
    return true;
  }

  // Collects completions of every live host; returns how many failed.
  int Drain(absl::Duration wait) {
    int failed = 0;
    for (int n = 0; n < kNodes; ++n) {
      Host& h = hosts_[n];
      if (!h.t) continue;
      Completion c[32];
      size_t got = h.t->WaitCompletions(absl::MakeSpan(c), wait);
      for (size_t i = 0; i < got; ++i) {
        auto it = h.outstanding.find(c[i].cookie);
        EXPECT_NE(it, h.outstanding.end()) << "unknown or repeated completion";
        if (it == h.outstanding.end()) continue;
        const Out& o = it->second;
        EXPECT_LE(sched_.now() - o.posted, bound_) << "request took too long";
        if (c[i].status.ok() && o.verify) Verify(n, o);
        if (!c[i].status.ok()) {
          ++failed;
          // The link is unusable after an error: forget it.
          for (auto l = h.links.begin(); l != h.links.end(); ++l) {
            if (l->second == o.wr.link) {
              EXPECT_TRUE(h.t->CloseLink(l->second).ok());
              h.links.erase(l);
              break;
            }
          }
        }
        h.outstanding.erase(it);
      }
    }
    return failed;
  }

  size_t Outstanding() const {
    size_t n = 0;
    for (const Host& h : hosts_) n += h.outstanding.size();
    return n;
  }

  sim::Scheduler& sched() { return sched_; }
  sim::Fabric& fabric() { return fabric_; }
  sim::Prng& traffic() { return traffic_; }
  uint64_t injector_seed() { return root_.Next64(); }

 private:
  struct Out {
    WorkRequest wr;
    int peer;
    bool verify;
    SimTime posted;
  };
  struct Host {
    std::unique_ptr<transport::SimTransport> t;
    transport::Region region;
    std::map<uint64_t, LinkId> links;
    std::map<uint64_t, Out> outstanding;
  };

  void Verify(int n, const Out& o) {
    const char* local = static_cast<const char*>(o.wr.local_addr);
    const char* remote = reinterpret_cast<const char*>(o.wr.remote_addr);
    EXPECT_EQ(std::memcmp(local, remote, o.wr.length), 0)
        << "request " << o.wr.cookie << " from host " << n << " reported success "
        << "but the bytes differ";
  }

  sim::Prng root_;
  sim::Scheduler sched_;
  sim::Fabric fabric_;
  sim::Prng traffic_;
  std::vector<std::vector<sim::NicId>> nics_;
  std::vector<std::vector<char>> mem_;
  std::vector<Host> hosts_;
  uint64_t next_cookie_ = 0;
  // Retry budget with a backlog of a few requests: generous but finite.
  SimTime bound_ = sim::ToSimTime(absl::Milliseconds(20));
};

struct SeedStats {
  sim::FaultCounts faults;
  int failed_in_fault_phase = 0;
};

void RunSeed(uint64_t seed, SeedStats* stats) {
  Cluster c(seed);
  sim::FaultSchedule s;
  s.partition = {1, 20};
  s.nic_down = {1, 20};
  s.crash = {1, 60};
  s.fault_phase = absl::Milliseconds(30);
  s.max_outage = absl::Milliseconds(3);
  sim::FaultInjector inj(
      &c.fabric(), c.injector_seed(), s, [&](NodeId n) { c.Crash(n); },
      [&](NodeId n) { c.Boot(n); });
  inj.Start();
  // Fault phase: unverified background traffic (concurrent requests may
  // share slots).
  while (c.sched().now() < inj.healed_at()) {
    for (int i = 0; i < 4; ++i) {
      const int from = c.traffic().Uniform(kNodes), to = c.traffic().Uniform(kNodes);
      c.Send(from, to, c.traffic().Chance({1, 2}) ? Opcode::kWrite : Opcode::kRead, false);
    }
    stats->failed_in_fault_phase += c.Drain(absl::Microseconds(100));
  }
  stats->faults = inj.counts();
  // Let the fault phase's requests finish (each within the bound).
  const SimTime drain_until = c.sched().now() + sim::ToSimTime(absl::Milliseconds(25));
  while (c.Outstanding() > 0 && c.sched().now() < drain_until) {
    stats->failed_in_fault_phase += c.Drain(absl::Microseconds(200));
  }
  ASSERT_EQ(c.Outstanding(), 0u) << "requests never completed";
  // Healed phase: one verified request per ordered pair and operation; the
  // first attempt may still find a stale link from the fault phase.
  for (Opcode op : {Opcode::kWrite, Opcode::kRead}) {
    for (int from = 0; from < kNodes; ++from) {
      for (int to = 0; to < kNodes; ++to) {
        if (from == to) continue;
        bool ok = false;
        for (int attempt = 0; attempt < 3 && !ok; ++attempt) {
          if (!c.Send(from, to, op, true)) continue;
          int failed = 0;
          while (c.Outstanding() > 0) failed += c.Drain(absl::Milliseconds(1));
          ok = failed == 0;
        }
        EXPECT_TRUE(ok) << "healed cluster still fails " << from << " -> " << to;
      }
    }
  }
}

TEST(SimCluster, FaultPhaseThenHealedPhaseAcrossSeeds) {
  SeedStats total;
  const std::vector<uint64_t> seeds = sim::SweepSeeds(1, 50);
  for (uint64_t seed : seeds) {
    SCOPED_TRACE(sim::ReplayCommand(seed));
    SeedStats stats;
    RunSeed(seed, &stats);
    total.faults.crashes += stats.faults.crashes;
    total.faults.partitions += stats.faults.partitions;
    total.faults.nic_downs += stats.faults.nic_downs;
    total.failed_in_fault_phase += stats.failed_in_fault_phase;
    if (HasFailure()) break;
  }
  // The sweep really exercised failures (not a vacuous pass).
  if (seeds.size() >= 12) {
    EXPECT_GT(total.faults.crashes, 0u);
    EXPECT_GT(total.faults.partitions, 0u);
    EXPECT_GT(total.faults.nic_downs, 0u);
    EXPECT_GT(total.failed_in_fault_phase, 0);
  }
  std::printf(
      "sweep of %zu seeds: %llu crashes, %llu partitions, %llu NIC outages, "
      "%d failed requests in fault phases\n",
      seeds.size(), (unsigned long long)total.faults.crashes,
      (unsigned long long)total.faults.partitions, (unsigned long long)total.faults.nic_downs,
      total.failed_in_fault_phase);
}

}  // namespace
}  // namespace kvferry
