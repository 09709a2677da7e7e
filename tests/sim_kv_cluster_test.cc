// A whole simulated serving cluster under a seeded fault schedule, at the
// level serving code uses: two prefill and two decode hosts, two data NICs
// each, engines handshaking over the simulated network, KV-layer requests
// (KvSender -> KvReceiver) from every prefill to every decode, while the
// fabric drops and delays packets, fails requests, partitions hosts, takes
// NICs down and crashes hosts (a restarted decode engine comes back on a new
// port with new keys and a new pool). Then everything heals. Checked on
// every seed:
//   * success means the bytes: a request the receiver reports complete (or
//     the sender reports sent) has every destination page equal to its
//     source page;
//   * every request ends, OK or with an error, within a bounded simulated
//     time (no hang, no lost completion);
//   * healed phase: every new request succeeds at the first attempt;
//   * nothing outside the targeted pages is ever written: every decode page
//     that was never a destination keeps its initial bytes.
// A failure prints the seed and the command that replays it; CI runs 200
// seeds, KVFERRY_SEEDS=N runs more.
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/kv_cache.h"
#include "gtest/gtest.h"
#include "sim/fault_injector.h"
#include "sim/prng.h"
#include "sim/seed.h"
#include "tests/sim_world.h"

namespace kvferry {
namespace {

using sim::NodeId;

constexpr int kPrefills = 2, kDecodes = 2;
const KvLayout kLayout{2, false, 4, 256, 64};  // 1 KiB pages, 64 per buffer
// A request ends within this much simulated time: the sender's timeout
// covers the slowest legitimate path (retries, a reconnect, peer_timeout).
const absl::Duration kRequestBound = absl::Milliseconds(300);

uint64_t Fill(uint64_t seed, uint32_t buffer, uint32_t page) {
  return seed * 0x9e3779b97f4a7c15ull ^ (uint64_t{buffer} << 32) ^ page;
}

void FillPool(const KvPool& pool, uint64_t seed) {
  const KvLayout& l = pool.layout();
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    for (uint32_t p = 0; p < l.pages; ++p) {
      const uint64_t v = Fill(seed, b, p);
      char* page = pool.buffer(b) + uint64_t{p} * l.page_bytes();
      for (uint64_t i = 0; i < l.page_bytes(); i += 8) std::memcpy(page + i, &v, 8);
    }
  }
}

bool SamePage(const KvPool& a, uint32_t buffer_a_page, const KvPool& b, uint32_t buffer_b_page,
              uint32_t buffer) {
  const uint64_t n = a.layout().page_bytes();
  return std::memcmp(a.buffer(buffer) + buffer_a_page * n, b.buffer(buffer) + buffer_b_page * n,
                     n) == 0;
}

struct Host {
  int world_host = 0;
  bool prefill = false;
  bool down = false;
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<KvSender> sender;
  std::unique_ptr<KvReceiver> receiver;
  KvPool pool;
  uint64_t fill_seed = 0;
  // Decode: pages ever targeted (per page index; all buffers alike).
  std::set<uint32_t> targeted;
};

struct Stats {
  sim::FaultCounts faults;
  uint64_t requests = 0, failed_in_fault_phase = 0, restarts = 0;
};

class KvCluster {
 public:
  explicit KvCluster(uint64_t seed)
      : w_(seed, sim::FaultOptions{{1, 2000}, {1, 50}, absl::Microseconds(50), {1, 400}}),
        traffic_(seed ^ 0x5eed) {
    EngineOptions o;
    o.slice_bytes = 4 << 10;
    o.peer_timeout = absl::Milliseconds(40);
    o.handshake_timeout = absl::Milliseconds(20);
    o.connect_timeout = absl::Milliseconds(20);
    w_.set_engine_options(o);
    const sim::NicSpec nic{25'000'000'000, absl::Microseconds(2), 4096};
    for (int i = 0; i < kPrefills + kDecodes; ++i) {
      Host h;
      h.world_host = w_.AddMultiNicHost({0, 1}, nic);
      h.prefill = i < kPrefills;
      hosts_.push_back(std::move(h));
    }
    for (size_t i = 0; i < hosts_.size(); ++i) Boot(i);
  }

  SimWorld& world() { return w_; }
  sim::Prng& traffic() { return traffic_; }
  Host& host(int i) { return hosts_[i]; }

  int HostOfNode(NodeId n) {
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (w_.node(hosts_[i].world_host) == n) return static_cast<int>(i);
    }
    return -1;
  }

  // Starts (or restarts) host i: a new engine on a new port, a new pool.
  void Boot(size_t i) {
    Host& h = hosts_[i];
    ++boots_[i];
    h.sender.reset();
    h.receiver.reset();
    h.engine.reset();
    auto e = w_.StartEngine(h.world_host);
    ASSERT_TRUE(e.ok()) << e.status();
    h.engine = std::move(*e);
    auto pool = KvPool::Allocate(kLayout);
    ASSERT_TRUE(pool.ok());
    h.pool = *pool;
    h.fill_seed = traffic_.Next64();
    FillPool(h.pool, h.fill_seed);
    h.targeted.clear();
    if (h.prefill) {
      KvSender::Options so;
      so.timeout = kRequestBound / 2;
      auto s = KvSender::Create(h.engine.get(), h.pool, so);
      ASSERT_TRUE(s.ok()) << s.status();
      h.sender = std::move(*s);
    } else {
      auto r = KvReceiver::Create(h.engine.get(), h.pool);
      ASSERT_TRUE(r.ok()) << r.status();
      h.receiver = std::move(*r);
    }
    h.down = false;
  }

  // The fault injector crashed host i's node: a decode's engine dies now;
  // a prefill's dies once its request in progress (on the stack) returns.
  void Crash(int i) {
    if (i < 0) return;
    hosts_[i].down = true;
    if (!hosts_[i].prefill) {
      hosts_[i].receiver.reset();
      hosts_[i].engine.reset();
    } else if (!busy_[i]) {
      hosts_[i].sender.reset();
      hosts_[i].engine.reset();
    }
  }
  void Restart(int i) {
    if (i < 0) return;
    if (busy_[i]) {
      restart_after_[i] = true;
      return;
    }
    Boot(i);
    ++restarts_;
  }

  // One request from prefill p to decode d: random pages. Returns whether
  // it succeeded; checks every invariant on the way.
  bool Request(int p, int d, bool must_succeed) {
    Host& from = hosts_[p];
    Host& to = hosts_[d];
    if (from.down || to.down || from.sender == nullptr || to.receiver == nullptr) return false;
    const uint32_t n = 1 + traffic_.Uniform(12);
    std::vector<uint32_t> src, dst;
    std::set<uint32_t> used;
    while (dst.size() < n) {
      const uint32_t page = traffic_.Uniform(kLayout.pages);
      if (!used.insert(page).second) continue;
      dst.push_back(page);
      src.push_back(traffic_.Uniform(kLayout.pages));
    }
    for (uint32_t page : dst) to.targeted.insert(page);
    const std::string id = "r" + std::to_string(++requests_);
    const std::string peer = to.engine->address();
    const KvPool dst_pool = to.pool;  // shared storage: stays valid if d restarts
    const uint64_t generation_to = restarts_seen(d);
    busy_[p] = true;
    const sim::SimTime start = w_.sched().now();
    absl::Status sent = from.sender->Send(id, peer, src, dst, "aux-" + id);
    const sim::SimTime took = w_.sched().now() - start;
    busy_[p] = false;
    EXPECT_LE(took, sim::ToSimTime(kRequestBound))
        << "request " << id << " took " << absl::FormatDuration(absl::Nanoseconds(took));
    // Success means the bytes, wherever success is reported. The decode
    // host may have restarted during the request (a new receiver, a new
    // pool): the incarnation that reports the request complete holds them.
    const bool restarted = restarts_seen(d) != generation_to;
    if (restarted) {
      // Begin may have fetched the new incarnation's pool: these pages are
      // legitimately its targets too.
      for (uint32_t page : dst) to.targeted.insert(page);
    }
    const bool d_alive = !to.down && to.receiver != nullptr;
    const KvReceiver::State state =
        d_alive ? to.receiver->Poll(id).state : KvReceiver::State::kPending;
    const KvPool* holder = nullptr;
    if (state == KvReceiver::State::kComplete) {
      holder = &to.pool;
    } else if (sent.ok() && !restarted && d_alive) {
      ADD_FAILURE() << "request " << id << " was sent, but the receiver did not hear of it";
    } else if (sent.ok() && !restarted) {
      holder = &dst_pool;  // crashed after completing: its memory is still here
    }
    // (sent, restarted, and the new incarnation never heard of it: the
    // data went to an incarnation that crashed; nothing left to check.)
    if (holder != nullptr) {
      for (uint32_t b = 0; b < kLayout.buffer_count(); ++b) {
        for (size_t i = 0; i < dst.size(); ++i) {
          EXPECT_TRUE(SamePage(from.pool, src[i], *holder, dst[i], b))
              << "request " << id << (sent.ok() ? " was sent" : " shows complete")
              << " but page " << dst[i] << " of buffer " << b << " differs";
        }
      }
    }
    if (must_succeed) {
      EXPECT_TRUE(sent.ok()) << "healed cluster: " << id << ": " << sent;
    }
    FinishDeferred(p);
    return sent.ok();
  }

  // Every decode page never targeted still holds its initial bytes.
  void CheckUntargeted() {
    for (Host& h : hosts_) {
      if (h.prefill || h.engine == nullptr) continue;
      for (uint32_t b = 0; b < kLayout.buffer_count(); ++b) {
        for (uint32_t page = 0; page < kLayout.pages; ++page) {
          if (h.targeted.count(page) != 0) continue;
          uint64_t v;
          std::memcpy(&v, h.pool.buffer(b) + uint64_t{page} * kLayout.page_bytes(), 8);
          ASSERT_EQ(v, Fill(h.fill_seed, b, page))
              << "page " << page << " of buffer " << b << " was written but never targeted";
        }
      }
    }
  }

  uint64_t requests() const { return requests_; }
  uint64_t restarts() const { return restarts_; }

 private:
  uint64_t restarts_seen(int i) { return boots_[i]; }
  void FinishDeferred(int p) {
    Host& h = hosts_[p];
    if (h.down && h.engine != nullptr) {
      h.sender.reset();
      h.engine.reset();
    }
    if (restart_after_[p]) {
      restart_after_[p] = false;
      Boot(p);
      ++restarts_;
    }
  }

  SimWorld w_;
  sim::Prng traffic_;
  std::vector<Host> hosts_;
  bool busy_[kPrefills + kDecodes] = {};
  bool restart_after_[kPrefills + kDecodes] = {};
  uint64_t boots_[kPrefills + kDecodes] = {};
  uint64_t requests_ = 0, restarts_ = 0;
};

void RunSeed(uint64_t seed, Stats* stats) {
  KvCluster c(seed);
  if (::testing::Test::HasFatalFailure()) return;
  sim::FaultSchedule s;
  s.tick = absl::Milliseconds(2);
  s.partition = {1, 15};
  s.nic_down = {1, 10};
  s.crash = {1, 25};
  s.min_outage = absl::Milliseconds(1);
  s.max_outage = absl::Milliseconds(20);
  s.fault_phase = absl::Milliseconds(150);
  sim::FaultInjector inj(
      &c.world().fabric(), seed ^ 0xfa17, s,
      [&](NodeId n) { c.Crash(c.HostOfNode(n)); }, [&](NodeId n) { c.Restart(c.HostOfNode(n)); });
  inj.Start();
  auto& sched = c.world().sched();
  // Fault phase: requests between random pairs; failures are allowed.
  while (sched.now() < inj.healed_at()) {
    const int p = c.traffic().Uniform(kPrefills), d = kPrefills + c.traffic().Uniform(kDecodes);
    if (!c.Request(p, d, false)) ++stats->failed_in_fault_phase;
    sched.RunUntil(sched.now() + sim::ToSimTime(absl::Microseconds(200)));
    if (::testing::Test::HasFailure()) return;
  }
  stats->faults = inj.counts();
  // Let every repair land.
  sched.RunUntil(inj.healed_at() + sim::ToSimTime(absl::Milliseconds(5)));
  // Healed phase: every pair, twice, each request succeeding first time.
  for (int round = 0; round < 2; ++round) {
    for (int p = 0; p < kPrefills; ++p) {
      for (int d = kPrefills; d < kPrefills + kDecodes; ++d) {
        c.Request(p, d, true);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
  c.CheckUntargeted();
  stats->requests = c.requests();
  stats->restarts = c.restarts();
}

TEST(SimKvCluster, FaultPhaseThenHealedPhaseAcrossSeeds) {
  Stats total;
  const std::vector<uint64_t> seeds = sim::SweepSeeds(1, 200);
  for (uint64_t seed : seeds) {
    SCOPED_TRACE(sim::ReplayCommand(seed));
    Stats s;
    RunSeed(seed, &s);
    total.requests += s.requests;
    total.failed_in_fault_phase += s.failed_in_fault_phase;
    total.restarts += s.restarts;
    total.faults.crashes += s.faults.crashes;
    total.faults.partitions += s.faults.partitions;
    total.faults.nic_downs += s.faults.nic_downs;
    if (HasFailure()) break;
  }
  std::printf("sweep of %zu seeds: %llu KV requests, %llu failed in fault phases; %llu crashes "
              "(%llu restarts), %llu partitions, %llu NIC outages\n",
              seeds.size(), (unsigned long long)total.requests,
              (unsigned long long)total.failed_in_fault_phase,
              (unsigned long long)total.faults.crashes, (unsigned long long)total.restarts,
              (unsigned long long)total.faults.partitions,
              (unsigned long long)total.faults.nic_downs);
  if (seeds.size() >= 20) {  // the sweep exercised failures (not a vacuous pass)
    EXPECT_GT(total.faults.crashes, 0u);
    EXPECT_GT(total.faults.partitions, 0u);
    EXPECT_GT(total.faults.nic_downs, 0u);
    EXPECT_GT(total.failed_in_fault_phase, 0u);
  }
}

}  // namespace
}  // namespace kvferry
