// A whole simulated serving cluster under a seeded fault schedule, at the
// level serving code uses: two prefill and two decode hosts, two data NICs
// each, engines handshaking over the simulated network, KV-layer requests
// (KvSender -> KvReceiver) from every prefill to every decode, while the
// fabric drops and delays packets (by up to 5 ms), fails requests, partitions hosts, takes
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
//     that was never a destination keeps its initial bytes;
//   * the decode declares each request (KvReceiver::Expect) and learns of
//     every failure within a bound, whether the prefill failed it, aborted
//     it mid-request (Cancel after the first layer), was killed mid-request
//     or was cut off;
//   * no write lands after a reported failure: the pages of a failed
//     request keep the bytes they had at the report until a later request
//     targets them;
//   * with checksums on, every corruption is detected: the fabric flips
//     bits of landing writes, and a request reported complete has every
//     page equal to its source (the receiver checked CRC-32Cs).
// A failure prints the seed and the command that replays it; CI runs 200
// seeds, KVFERRY_SEEDS=N runs more.
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "engine/testing/sim_world.h"
#include "gtest/gtest.h"
#include "kv/kv_cache.h"
#include "sim/fault_injector.h"
#include "sim/prng.h"
#include "sim/seed.h"

namespace kvferry {
namespace {

using sim::NodeId;

constexpr int kPrefills = 2, kDecodes = 2;
const KvLayout kLayout{2, false, 4, 256, 64};  // 1 KiB pages, 64 per buffer
// One message in 50 is delayed by up to this: five times the transport's
// ack timeout, so links time out and slices go again while their first
// copies are still on the way, and an aborted request's last writes arrive
// after the abort.
const absl::Duration kMaxDelay = absl::Milliseconds(5);
// A request ends within this much simulated time: the sender's timeout
// covers the slowest legitimate path (retries, a reconnect, peer_timeout).
const absl::Duration kRequestBound = absl::Milliseconds(300);
// The decodes' KvReceiver peer_timeout, and the bound on learning of a
// failed request after the sender gave up (plus scheduling slack).
const absl::Duration kReceiverPeerTimeout = absl::Milliseconds(40);
const absl::Duration kReportBound = kReceiverPeerTimeout + absl::Milliseconds(20);

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
  // Decode: pages of failed requests and their bytes (every buffer) at the
  // report, until a later request targets them.
  std::map<uint32_t, std::string> fenced_pages;
  std::map<uint32_t, std::string> fenced_why;  // the request and its failure
};

struct Stats {
  sim::FaultCounts faults;
  uint64_t requests = 0, failed_in_fault_phase = 0, restarts = 0;
  uint64_t aborted = 0, killed = 0, reported_failed = 0, corruptions_detected = 0;
  uint64_t fenced_restarts = 0;
  uint64_t unconfirmed_after_death = 0;
};

class KvCluster {
 public:
  explicit KvCluster(uint64_t seed)
      : w_(seed, sim::FaultOptions{{1, 2000}, {1, 50}, kMaxDelay, {1, 400}, {1, 500}}),
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
    h.fenced_pages.clear();
    if (h.prefill) {
      KvSender::Options so;
      so.timeout = kRequestBound / 2;
      so.checksums = true;
      so.tell_timeout = kReceiverPeerTimeout;
      auto s = KvSender::Create(h.engine.get(), h.pool, so);
      ASSERT_TRUE(s.ok()) << s.status();
      h.sender = std::move(*s);
    } else {
      KvReceiver::Options ro;
      ro.peer_timeout = kReceiverPeerTimeout;
      auto r = KvReceiver::Create(h.engine.get(), h.pool, ro);
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
    if (!hosts_[i].prefill && !busy_[i]) {
      hosts_[i].receiver.reset();
      hosts_[i].engine.reset();
    } else if (hosts_[i].prefill && !busy_[i]) {
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
    for (uint32_t page : dst) {
      to.targeted.insert(page);
      CheckFenced(to, page);
    }
    const std::string id = "r" + std::to_string(++requests_);
    const std::string peer = to.engine->address();
    const KvPool dst_pool = to.pool;  // shared storage: stays valid if d restarts
    const uint64_t generation_to = restarts_seen(d);
    // The decode declares what it expects, as serving code does.
    EXPECT_TRUE(to.receiver->Expect(id, from.engine->address(), from.engine->engine_id()).ok());
    busy_[p] = true;
    const sim::SimTime start = w_.sched().now();
    // Mostly whole requests; sometimes the prefill aborts after the first
    // layer, or is killed there (the process dies: no word to the decode).
    const uint32_t how = must_succeed ? 0 : traffic_.Uniform(8);
    absl::Status sent;
    if (how <= 5) {
      sent = from.sender->Send(id, peer, src, dst, "aux-" + id);
    } else {
      auto h = from.sender->Begin(id, peer, src, dst);
      sent = h.ok() ? from.sender->SendLayer(*h, 0) : h.status();
      if (h.ok() && how == 6) {
        (void)from.sender->Cancel(*h, "aborted by the sweep");
        sent = absl::CancelledError("aborted");
        ++aborted_;
      } else if (h.ok()) {
        from.down = true;  // killed mid-request; restarted below
        restart_after_[p] = true;
        sent = absl::AbortedError("killed");
        ++killed_;
      }
    }
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
    // A word counts once its sender confirms it (one more round trip, which
    // the faults may delay): a sent request is waited for that long.
    // The receiver runs the simulation while it asks (a confirmation): a
    // crash of the decode then waits for the call to return, as a busy
    // prefill's does (FinishDeferred below).
    KvReceiver::Status heard;
    busy_[d] = d_alive;
    if (d_alive && sent.ok()) {
      heard = to.receiver->Wait(id, kReceiverPeerTimeout).value_or(KvReceiver::Status{});
    } else if (d_alive) {
      heard = to.receiver->Poll(id);
    }
    busy_[d] = false;
    const KvReceiver::State state = heard.state;
    const KvPool* holder = nullptr;
    if (state == KvReceiver::State::kComplete) {
      holder = &to.pool;
    } else if (sent.ok() && !restarted && d_alive &&
               heard.error.code() == absl::StatusCode::kDataLoss) {
      // Sent, but a page arrived corrupted: the checksums caught it.
      ++corruptions_detected_;
    } else if (sent.ok() && !restarted && d_alive && state == KvReceiver::State::kFailed &&
               heard.error.code() == absl::StatusCode::kUnavailable &&
               absl::StartsWith(heard.error.message(), "the prefill at ")) {
      // Sent, but its prefill died, restarted or was cut off before it
      // confirmed its word (the receiver's liveness report, nothing else):
      // the decode cannot tell that word from a forged one, and fails the
      // request (safe: the bytes are not used).
      ++unconfirmed_after_death_;
    } else if (sent.ok() && !restarted && d_alive) {
      ADD_FAILURE() << "request " << id << " was sent, but the receiver did not hear of it: "
                    << (state == KvReceiver::State::kPending ? "pending" : heard.error.ToString());
    } else if (sent.ok() && !restarted) {
      holder = &dst_pool;  // crashed after completing: its memory is still here
    }
    // (sent, restarted, and the new incarnation never heard of it: the
    // data went to an incarnation that crashed; nothing left to check.)
    if (holder != nullptr) {
      for (uint32_t b = 0; b < kLayout.buffer_count(); ++b) {
        for (size_t i = 0; i < dst.size(); ++i) {
          EXPECT_TRUE(SamePage(from.pool, src[i], *holder, dst[i], b))
              << "request " << id << (sent.ok() ? " was sent" : " shows complete") << " but page "
              << dst[i] << " of buffer " << b << " differs";
        }
      }
    }
    if (must_succeed) {
      EXPECT_TRUE(sent.ok()) << "healed cluster: " << id << ": " << sent;
    }
    FinishDeferred(p);
    // Crashed while the receiver asked: torn down (and restarted) now, and
    // its report of this request lost with it.
    const bool d_crashed = to.down || restart_after_[d];
    FinishDeferred(d);
    if (!sent.ok() && !restarted && d_alive && !d_crashed &&
        state != KvReceiver::State::kComplete) {
      ExpectReportedFailure(d, id, dst, sent);
    }
    return sent.ok();
  }

  // The decode learns that request `id` failed within kReportBound, and
  // from then on its pages keep their bytes until a later request.
  void ExpectReportedFailure(int d, const std::string& id, const std::vector<uint32_t>& dst,
                             const absl::Status& sent) {
    Host& to = hosts_[d];
    const sim::SimTime start = w_.sched().now();
    const uint64_t generation = restarts_seen(d);
    busy_[d] = true;  // a crash meanwhile tears it down after Wait returns
    auto st = to.receiver->Wait(id, kReportBound * 4);
    busy_[d] = false;
    const sim::SimTime took = w_.sched().now() - start;
    const bool crashed = to.down;
    FinishDeferred(d);
    if (crashed || restarts_seen(d) != generation) return;
    ASSERT_TRUE(st.ok()) << "request " << id << ": the decode still has no word after "
                         << absl::FormatDuration(absl::Nanoseconds(took)) << ": " << st.status()
                         << "; the sender said: " << sent;
    EXPECT_LE(took, sim::ToSimTime(kReportBound))
        << "request " << id << ": failure reported after "
        << absl::FormatDuration(absl::Nanoseconds(took)) << ": "
        << (st->state == KvReceiver::State::kComplete ? "complete" : st->error.ToString());
    if (st->state == KvReceiver::State::kComplete) return;  // its word was "done" after all
    ++reported_failed_;
    const uint64_t n = kLayout.page_bytes();
    for (uint32_t page : dst) {
      std::string bytes;
      for (uint32_t b = 0; b < kLayout.buffer_count(); ++b) {
        bytes.append(to.pool.buffer(b) + uint64_t{page} * n, n);
      }
      to.fenced_pages[page] = std::move(bytes);
      to.fenced_why[page] = id + " (" + sent.ToString() + " / " + st->error.ToString() + ")";
    }
  }

  // A page of a failed request still holds its bytes from the report.
  void CheckFenced(Host& h, uint32_t page) {
    auto it = h.fenced_pages.find(page);
    if (it == h.fenced_pages.end()) return;
    const uint64_t n = kLayout.page_bytes();
    for (uint32_t b = 0; b < kLayout.buffer_count(); ++b) {
      EXPECT_EQ(std::memcmp(h.pool.buffer(b) + uint64_t{page} * n, it->second.data() + b * n, n), 0)
          << "page " << page << " of buffer " << b
          << " was written after its request was reported failed: " << h.fenced_why[page];
    }
    h.fenced_pages.erase(it);
  }

  // The supervisor: a prefill some decode declared failed (and fenced) is
  // restarted, as serving frameworks restart a worker their peers gave up
  // on; until then that decode refuses it.
  void Supervise() {
    for (int p = 0; p < kPrefills; ++p) {
      Host& h = hosts_[p];
      if (h.down || h.engine == nullptr) continue;
      for (int d = kPrefills; d < kPrefills + kDecodes; ++d) {
        Host& to = hosts_[d];
        if (to.down || to.engine == nullptr || !to.engine->PeerFenced(h.engine->engine_id())) {
          continue;
        }
        Boot(p);
        ++restarts_;
        ++fenced_restarts_;
        break;
      }
    }
  }

  // Every decode page never targeted still holds its initial bytes.
  void CheckUntargeted() {
    for (Host& h : hosts_) {
      if (h.prefill || h.engine == nullptr) continue;
      while (!h.fenced_pages.empty()) CheckFenced(h, h.fenced_pages.begin()->first);
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
  void AddCounts(Stats* s) const {
    s->aborted += aborted_;
    s->killed += killed_;
    s->reported_failed += reported_failed_;
    s->corruptions_detected += corruptions_detected_;
    s->fenced_restarts += fenced_restarts_;
    s->unconfirmed_after_death += unconfirmed_after_death_;
  }

 private:
  uint64_t restarts_seen(int i) { return boots_[i]; }
  void FinishDeferred(int p) {
    Host& h = hosts_[p];
    if (h.down && h.engine != nullptr) {
      h.sender.reset();
      h.receiver.reset();
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
  uint64_t aborted_ = 0, killed_ = 0, reported_failed_ = 0, corruptions_detected_ = 0;
  uint64_t unconfirmed_after_death_ = 0;  // sent, its sender gone before it confirmed the word
  uint64_t fenced_restarts_ = 0;
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
      &c.world().fabric(), seed ^ 0xfa17, s, [&](NodeId n) { c.Crash(c.HostOfNode(n)); },
      [&](NodeId n) { c.Restart(c.HostOfNode(n)); });
  inj.Start();
  auto& sched = c.world().sched();
  // Fault phase: requests between random pairs; failures are allowed.
  while (sched.now() < inj.healed_at()) {
    const int p = c.traffic().Uniform(kPrefills), d = kPrefills + c.traffic().Uniform(kDecodes);
    if (!c.Request(p, d, false)) ++stats->failed_in_fault_phase;
    c.Supervise();
    sched.RunUntil(sched.now() + sim::ToSimTime(absl::Microseconds(200)));
    if (::testing::Test::HasFailure()) return;
  }
  stats->faults = inj.counts();
  // Let every repair land.
  sched.RunUntil(inj.healed_at() + sim::ToSimTime(absl::Milliseconds(5)));
  c.Supervise();
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
  c.AddCounts(stats);
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
    total.aborted += s.aborted;
    total.killed += s.killed;
    total.reported_failed += s.reported_failed;
    total.corruptions_detected += s.corruptions_detected;
    total.fenced_restarts += s.fenced_restarts;
    total.unconfirmed_after_death += s.unconfirmed_after_death;
    if (HasFailure()) break;
  }
  std::printf(
      "sweep of %zu seeds: %llu aborted and %llu killed mid-request; the decodes "
      "reported %llu failed requests in bound; %llu corrupted requests detected "
      "(checksums); %llu prefills restarted after a decode fenced them; %llu sent requests "
      "failed because their prefill was gone before it confirmed its word\n",
      seeds.size(), (unsigned long long)total.aborted, (unsigned long long)total.killed,
      (unsigned long long)total.reported_failed, (unsigned long long)total.corruptions_detected,
      (unsigned long long)total.fenced_restarts, (unsigned long long)total.unconfirmed_after_death);
  std::printf(
      "sweep of %zu seeds: %llu KV requests, %llu failed in fault phases; %llu crashes "
      "(%llu restarts), %llu partitions, %llu NIC outages\n",
      seeds.size(), (unsigned long long)total.requests,
      (unsigned long long)total.failed_in_fault_phase, (unsigned long long)total.faults.crashes,
      (unsigned long long)total.restarts, (unsigned long long)total.faults.partitions,
      (unsigned long long)total.faults.nic_downs);
  if (seeds.size() >= 20) {  // the sweep exercised failures (not a vacuous pass)
    EXPECT_GT(total.faults.crashes, 0u);
    EXPECT_GT(total.faults.partitions, 0u);
    EXPECT_GT(total.faults.nic_downs, 0u);
    EXPECT_GT(total.failed_in_fault_phase, 0u);
    EXPECT_GT(total.aborted, 0u);
    EXPECT_GT(total.killed, 0u);
    EXPECT_GT(total.corruptions_detected, 0u);
  }
}

}  // namespace
}  // namespace kvferry
