// SimTransport behaviour beyond the conformance suite: the timing model,
// determinism under faults, NIC/node failures, restarts and multi-NIC keys.
#include "transport/sim/sim_transport.h"

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "sim/seed.h"
#include "transport/in_process.h"
#include "transport/sim/sim_harness.h"

namespace kvferry {
namespace transport {
namespace {

using sim::SimTime;

struct Linked {
  LinkId a = 0, b = 0;
};

Linked Connect(Transport& a, Transport& b, NicIndex na = 0, NicIndex nb = 0) {
  auto links = ConnectInProcess(a, b, na, nb);
  EXPECT_TRUE(links.ok()) << links.status();
  return links.ok() ? Linked{links->first, links->second} : Linked{};
}

WorkRequest Req(Opcode op, LinkId link, const Region& local, void* local_addr, uint64_t len,
                uint64_t remote_addr, RemoteKey key, uint64_t cookie = 1) {
  WorkRequest wr;
  wr.opcode = op;
  wr.link = link;
  wr.local_region = local.id;
  wr.local_addr = local_addr;
  wr.length = len;
  wr.remote_addr = remote_addr;
  wr.remote_key = key;
  wr.cookie = cookie;
  return wr;
}

absl::Status RunOne(Transport& t, const WorkRequest& wr,
                    absl::Duration timeout = absl::Seconds(1)) {
  absl::Status posted = t.Post({&wr, 1});
  if (!posted.ok()) return posted;
  Completion c;
  if (t.WaitCompletions({&c, 1}, timeout) != 1) {
    return absl::DeadlineExceededError("no completion");
  }
  EXPECT_EQ(c.cookie, wr.cookie);
  return c.status;
}

// Two hosts on one fabric, a source buffer on `a`, a target on `b`, both
// registered, and a link from a's NIC 0 to b's NIC 0.
struct World {
  World(uint64_t seed, size_t bytes, Access target = Access::kRemoteWrite,
        sim::FaultOptions faults = {}, int nics = 2, sim::NicSpec spec = {})
      : h(seed, faults, nics), src(bytes, 's'), dst(bytes, 'd') {
    h.set_nic_spec(spec);
    a = *h.NewSimTransport();
    b = *h.NewSimTransport();
    l = Connect(*a, *b);
    rs = *a->RegisterMemory(src.data(), src.size(), Access::kNone);
    rd = *b->RegisterMemory(dst.data(), dst.size(), target);
  }
  // A request of `len` bytes at offset `off` of both buffers.
  WorkRequest Req(Opcode op, size_t len, size_t off = 0, uint64_t cookie = 1, LinkId link = 0,
                  NicIndex nic = 0) {
    return transport::Req(op, link ? link : l.a, rs, src.data() + off, len, rd.addr + off,
                          rd.keys[nic], cookie);
  }

  SimHarness h;
  std::unique_ptr<SimTransport> a, b;
  Linked l;
  std::vector<char> src, dst;
  Region rs, rd;
};

TEST(SimTransport, WriteCompletesAtTheModelledTime) {
  // 1 MiB over 8 Gb/s NICs, 1 us each, MTU 4096, 64 header bytes: 256
  // segments of 4160 wire bytes back to back, then 2 us to the target, then
  // the last 64-byte acknowledgement back.
  World w(1, 1 << 20, Access::kRemoteWrite, {}, 1, {8'000'000'000, absl::Microseconds(1), 4096});
  const SimTime start = w.h.scheduler().now();
  ASSERT_TRUE(RunOne(*w.a, w.Req(Opcode::kWrite, 1 << 20)).ok());
  const SimTime per_segment = sim::Fabric::SerializationTime(4096 + 64, 8'000'000'000);
  const SimTime expected =
      256 * per_segment + 2000 + sim::Fabric::SerializationTime(64, 8'000'000'000) + 2000;
  EXPECT_EQ(w.h.scheduler().now() - start, expected);
  EXPECT_EQ(w.src, w.dst);
}

TEST(SimTransport, ReadCompletesAtTheModelledTime) {
  SimHarness h(1, {}, 1);
  h.set_nic_spec({8'000'000'000, absl::Microseconds(1), 4096});
  auto a = *h.NewSimTransport();
  auto b = *h.NewSimTransport();
  Linked l = Connect(*a, *b);
  std::vector<char> local(8192, 0), remote(8192, 'r');
  Region rl = *a->RegisterMemory(local.data(), local.size(), Access::kNone);
  Region rr = *b->RegisterMemory(remote.data(), remote.size(), Access::kRemoteRead);
  const SimTime start = h.scheduler().now();
  ASSERT_TRUE(
      RunOne(*a, Req(Opcode::kRead, l.a, rl, local.data(), 8192, rr.addr, rr.keys[0])).ok());
  // Two 64-byte requests out (back to back), two 4160-byte responses back.
  const SimTime hdr = sim::Fabric::SerializationTime(64, 8'000'000'000);
  const SimTime seg = sim::Fabric::SerializationTime(4096 + 64, 8'000'000'000);
  // Second request arrives at 2*hdr + 2us; its response leaves after the
  // first one (which started at hdr + 2us), and arrives 2 us later.
  const SimTime first_resp_end = hdr + 2000 + seg;
  const SimTime second_resp_end = std::max(first_resp_end, 2 * hdr + 2000) + seg;
  EXPECT_EQ(h.scheduler().now() - start, second_resp_end + 2000);
  EXPECT_EQ(local, remote);
}

TEST(SimTransport, KeysArePerNic) {
  World w(3, 64);
  Linked l1 = Connect(*w.a, *w.b, 1, 1);
  ASSERT_EQ(w.rd.keys.size(), 2u);
  EXPECT_NE(w.rd.keys[0], w.rd.keys[1]);
  // NIC 0's key on a link arriving at NIC 1 is refused.
  EXPECT_EQ(RunOne(*w.a, w.Req(Opcode::kWrite, 64, 0, 1, l1.a, 0)).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(w.dst, std::vector<char>(64, 'd'));
  Linked l2 = Connect(*w.a, *w.b, 1, 1);
  EXPECT_TRUE(RunOne(*w.a, w.Req(Opcode::kWrite, 64, 0, 1, l2.a, 1)).ok());
  EXPECT_EQ(w.dst, w.src);
}

TEST(SimTransport, NicDownFailsItsLinksOnlyAndRecovers) {
  World w(4, 4096);
  Linked l1 = Connect(*w.a, *w.b, 1, 1);
  w.h.fabric().topology().SetNicUp(w.h.nics_of(1)[0], false);
  EXPECT_EQ(RunOne(*w.a, w.Req(Opcode::kWrite, 100), w.a->PeerLossBound()).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(w.dst[0], 'd');
  EXPECT_TRUE(RunOne(*w.a, w.Req(Opcode::kWrite, 100, 0, 1, l1.a, 1)).ok());
  EXPECT_EQ(w.dst[99], 's');
  w.h.fabric().topology().SetNicUp(w.h.nics_of(1)[0], true);
  Linked again = Connect(*w.a, *w.b, 0, 0);
  EXPECT_TRUE(RunOne(*w.a, w.Req(Opcode::kWrite, 4096, 0, 1, again.a)).ok());
  EXPECT_EQ(w.dst, w.src);
}

TEST(SimTransport, PartitionFailsThenHealedPathWorks) {
  World w(5, 512, Access::kRemoteReadWrite);
  w.h.fabric().topology().Partition({0}, {1});
  EXPECT_EQ(RunOne(*w.a, w.Req(Opcode::kRead, 512), w.a->PeerLossBound()).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(w.src, std::vector<char>(512, 's'));
  w.h.fabric().topology().Heal();
  Linked healed = Connect(*w.a, *w.b);
  EXPECT_TRUE(RunOne(*w.a, w.Req(Opcode::kRead, 512, 0, 1, healed.a)).ok());
  EXPECT_EQ(w.src, w.dst);
}

TEST(SimTransport, ShortPartitionIsHiddenByRetransmission) {
  World w(6, 64 << 10);
  w.h.fabric().topology().Partition({0}, {1});
  w.h.scheduler().After(sim::ToSimTime(absl::Milliseconds(3)),
                        [&] { w.h.fabric().topology().Heal(); });
  EXPECT_TRUE(RunOne(*w.a, w.Req(Opcode::kWrite, 64 << 10)).ok());
  EXPECT_EQ(w.src, w.dst);
}

TEST(SimTransport, RestartedPeerHasNewKeysAndOldLinksFail) {
  SimHarness h(7);
  auto a = *h.NewSimTransport();
  auto b = *h.NewSimTransport();
  Linked l = Connect(*a, *b);
  std::vector<char> src(256, 's'), dst(256, 'd');
  Region rs = *a->RegisterMemory(src.data(), src.size(), Access::kNone);
  Region old_rd = *b->RegisterMemory(dst.data(), dst.size(), Access::kRemoteWrite);
  // Crash: the process dies, then comes back on the same node and NICs.
  b.reset();
  h.fabric().topology().SetNodeUp(1, false);
  h.scheduler().SleepFor(absl::Milliseconds(1));
  h.fabric().topology().SetNodeUp(1, true);
  b = *h.NewSimTransport(/*node=*/1);
  Region new_rd = *b->RegisterMemory(dst.data(), dst.size(), Access::kRemoteWrite);
  EXPECT_NE(new_rd.keys[0], old_rd.keys[0]);
  // The old link leads to a queue pair that no longer exists.
  EXPECT_EQ(RunOne(*a, Req(Opcode::kWrite, l.a, rs, src.data(), 256, new_rd.addr, new_rd.keys[0]),
                   a->PeerLossBound())
                .code(),
            absl::StatusCode::kUnavailable);
  // A new link with a stale key is refused; with the new key it works.
  Linked fresh = Connect(*a, *b);
  EXPECT_EQ(
      RunOne(*a, Req(Opcode::kWrite, fresh.a, rs, src.data(), 256, old_rd.addr, old_rd.keys[0]))
          .code(),
      absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(dst, std::vector<char>(256, 'd'));
  Linked fresh2 = Connect(*a, *b);
  EXPECT_TRUE(
      RunOne(*a, Req(Opcode::kWrite, fresh2.a, rs, src.data(), 256, new_rd.addr, new_rd.keys[0]))
          .ok());
  EXPECT_EQ(dst, src);
}

TEST(SimTransport, InjectedErrorCompletionFailsLinkAndFlushesRest) {
  sim::FaultOptions f;
  f.error_completion = sim::Ratio::Always();
  World w(8, 4 * 4096, Access::kRemoteWrite, f);
  std::vector<WorkRequest> batch;
  for (int i = 0; i < 4; ++i) batch.push_back(w.Req(Opcode::kWrite, 4096, i * 4096, i));
  ASSERT_TRUE(w.a->Post(batch).ok());
  Completion c[8];
  size_t n = 0;
  while (n < 4) {
    size_t got = w.a->WaitCompletions(absl::MakeSpan(c + n, 8 - n), absl::Seconds(1));
    ASSERT_GT(got, 0u);
    n += got;
  }
  std::map<absl::StatusCode, int> codes;
  for (size_t i = 0; i < n; ++i) ++codes[c[i].status.code()];
  EXPECT_EQ(codes[absl::StatusCode::kUnavailable], 1);
  EXPECT_EQ(codes[absl::StatusCode::kAborted], 3);
}

TEST(SimTransport, DestroyedWhileWaitingReturnsCleanly) {
  // A simulated crash may destroy the transport whose WaitCompletions is
  // running the scheduler; the call must return without touching it.
  SimHarness h(10);
  auto a = *h.NewSimTransport();
  auto b = *h.NewSimTransport();
  Linked l = Connect(*a, *b);
  std::vector<char> src(64, 's'), dst(64, 'd');
  Region rs = *a->RegisterMemory(src.data(), 64, Access::kNone);
  Region rd = *b->RegisterMemory(dst.data(), 64, Access::kRemoteWrite);
  h.fabric().topology().SetNodeUp(1, false);  // the request will never be answered
  WorkRequest wr = Req(Opcode::kWrite, l.a, rs, src.data(), 64, rd.addr, rd.keys[0]);
  ASSERT_TRUE(a->Post({&wr, 1}).ok());
  SimTransport* raw = a.get();
  h.scheduler().After(sim::ToSimTime(absl::Microseconds(50)), [&] { a.reset(); });
  Completion c;
  EXPECT_EQ(raw->WaitCompletions({&c, 1}, absl::Seconds(1)), 0u);
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(h.scheduler().now(), sim::ToSimTime(absl::Microseconds(50)));
}

TEST(SimTransport, CreateRejectsBadOptions) {
  SimHarness h(9);
  SimTransportOptions o;
  EXPECT_EQ(SimTransport::Create(&h.fabric(), o, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.nics = {12345};
  EXPECT_EQ(SimTransport::Create(&h.fabric(), o, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto n0 = h.fabric().topology().AddNode("x");
  auto n1 = h.fabric().topology().AddNode("y");
  o.nics = {*h.fabric().topology().AddNic(n0, {}), *h.fabric().topology().AddNic(n1, {})};
  EXPECT_EQ(SimTransport::Create(&h.fabric(), o, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A lossy three-node cluster moving disjoint ranges over every NIC pair.
// Returns the trace hash and checks, on the way, that every request
// completes exactly once and that each successful one moved its bytes.
struct ClusterRun {
  uint64_t hash = 0;
  std::vector<std::pair<uint64_t, int>> completions;  // (cookie, code)
};

ClusterRun RunCluster(uint64_t seed) {
  sim::FaultOptions f;
  f.drop = {1, 40};
  f.delay = {1, 8};
  f.max_delay = absl::Microseconds(30);
  f.error_completion = {1, 60};
  SimHarness h(seed, f);
  std::vector<std::unique_ptr<SimTransport>> t;
  for (int i = 0; i < 3; ++i) t.push_back(*h.NewSimTransport());
  const size_t kSlot = 24 << 10, kSlots = 24;
  std::vector<std::vector<char>> mem(3, std::vector<char>(kSlot * kSlots));
  std::vector<Region> regions;
  for (int i = 0; i < 3; ++i) {
    for (size_t j = 0; j < mem[i].size(); ++j) mem[i][j] = char(i * 31 + j * 7);
    regions.push_back(
        *t[i]->RegisterMemory(mem[i].data(), mem[i].size(), Access::kRemoteReadWrite));
  }
  const std::vector<std::vector<char>> original = mem;
  sim::Prng prng(seed ^ 0xc1u);
  struct Expect {
    int from, to;
    Opcode op;
    size_t local_off, remote_off, len;
  };
  std::map<uint64_t, Expect> expects;
  uint64_t cookie = 0;
  // Node i writes/reads slot (i*8 + k) of its own memory to/from slot
  // (i*8 + k) of a peer, so no two requests touch the same bytes.
  for (int i = 0; i < 3; ++i) {
    for (int k = 0; k < 8; ++k) {
      const int peer = (i + 1 + k % 2) % 3;
      const NicIndex nic = k % 2;
      Linked l = Connect(*t[i], *t[peer], nic, nic);
      const size_t slot = (i * 8 + k) * kSlot;
      const size_t len = 1 + prng.Uniform(kSlot - 1);
      const Opcode op = prng.Chance({1, 2}) ? Opcode::kWrite : Opcode::kRead;
      expects[cookie] = {i, peer, op, slot, slot, len};
      EXPECT_TRUE(t[i]->Post({Req(op, l.a, regions[i], mem[i].data() + slot, len,
                                  regions[peer].addr + slot, regions[peer].keys[nic], cookie)})
                      .ok());
      ++cookie;
    }
  }
  ClusterRun run;
  std::vector<int> pending(3, 8);
  for (int round = 0; round < 1000; ++round) {
    bool any = false;
    for (int i = 0; i < 3; ++i) {
      Completion c[8];
      size_t n = t[i]->WaitCompletions(absl::MakeSpan(c), absl::Microseconds(100));
      for (size_t j = 0; j < n; ++j) {
        run.completions.emplace_back(c[j].cookie, int(c[j].status.code()));
        --pending[i];
        const Expect& e = expects.at(c[j].cookie);
        EXPECT_EQ(e.from, i);
        if (!c[j].status.ok()) continue;
        const char* dst =
            e.op == Opcode::kWrite ? &mem[e.to][e.remote_off] : &mem[e.from][e.local_off];
        const char* src =
            e.op == Opcode::kWrite ? &original[e.from][e.local_off] : &original[e.to][e.remote_off];
        EXPECT_EQ(std::memcmp(dst, src, e.len), 0) << "cookie " << c[j].cookie;
      }
      any |= pending[i] > 0;
    }
    if (!any) break;
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(pending[i], 0) << "node " << i;
  // Bytes no request touched are as they were.
  for (int node = 0; node < 3; ++node) {
    std::vector<bool> touched(mem[node].size());
    for (const auto& [id, e] : expects) {
      if (e.op == Opcode::kWrite && e.to == node) {
        for (size_t b = 0; b < e.len; ++b) touched[e.remote_off + b] = true;
      }
      if (e.op == Opcode::kRead && e.from == node) {
        for (size_t b = 0; b < e.len; ++b) touched[e.local_off + b] = true;
      }
    }
    size_t changed = 0;
    for (size_t b = 0; b < touched.size(); ++b) {
      changed += !touched[b] && mem[node][b] != original[node][b];
    }
    EXPECT_EQ(changed, 0u) << "bytes outside every request changed on node " << node;
  }
  run.hash = h.scheduler().trace_hash();
  return run;
}

TEST(SimTransportDeterminism, SameSeedSameTraceAcrossASweep) {
  for (uint64_t seed : sim::SweepSeeds(1, 20)) {
    SCOPED_TRACE(sim::ReplayCommand(seed));
    ClusterRun first = RunCluster(seed);
    ClusterRun second = RunCluster(seed);
    EXPECT_EQ(first.hash, second.hash);
    EXPECT_EQ(first.completions, second.completions);
    EXPECT_EQ(first.completions.size(), 24u);
    if (HasFailure()) break;
  }
}

TEST(SimTransportDeterminism, DifferentSeedsDiverge) {
  EXPECT_NE(RunCluster(11).hash, RunCluster(12).hash);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
