// The path choice from facts alone: no network, no driver, no pipeline.
#include "engine/pipeline/path_choice.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/kinds.h"

namespace kvferry {
namespace engine_internal {
namespace {

using Action = PathStep::Action;
using transport::kind::kCudaIpc;
using transport::kind::kTcp;
using transport::kind::kVerbs;

const std::vector<std::string> kRdmaHost = {kVerbs, kTcp};
const std::vector<std::string> kTcpHost = {kTcp};
// What Create makes where a CUDA driver loads.
const std::vector<std::string> kRdmaGpuHost = {kVerbs, kTcp, kCudaIpc};
const std::vector<std::string> kTcpGpuHost = {kTcp, kCudaIpc};

HostFacts GpuHost() {
  HostFacts f;
  f.cuda = true;
  f.addresses = {{"eth0", "10.0.0.5", 2, true, false}};
  return f;
}

PeerFacts Peer(std::string host) {
  PeerFacts p;
  p.host = std::move(host);
  return p;
}

TEST(ChoosePath, APeerOnThisGpuHostGoesOverCudaIpcFirstThenTheUsualWay) {
  for (const auto& mine : {kRdmaGpuHost, kTcpGpuHost}) {
    for (const std::string& host : {"10.0.0.5", "127.0.0.1"}) {
      PeerFacts peer = Peer(host);
      PathStep s = ChoosePath(mine, peer, GpuHost());
      EXPECT_EQ(s.action, Action::kConnect) << host;
      EXPECT_EQ(s.via, mine.size() - 1);
      EXPECT_EQ(s.kind, kCudaIpc);
      EXPECT_NE(s.why.find("on this host"), std::string::npos) << s.why;
      peer.same_host_tried = true;  // it failed (or the peer lacks it): the usual choice
      EXPECT_EQ(ChoosePath(mine, peer, GpuHost()).action,
                mine == kTcpGpuHost ? Action::kOneRoundTrip : Action::kDescribe);
    }
  }
  // Another host, no driver, or no cuda_ipc transport: the usual choice.
  EXPECT_EQ(ChoosePath(kRdmaGpuHost, Peer("10.0.0.6"), GpuHost()).action, Action::kDescribe);
  HostFacts no_gpu = GpuHost();
  no_gpu.cuda = false;
  EXPECT_EQ(ChoosePath(kRdmaGpuHost, Peer("10.0.0.5"), no_gpu).action, Action::kDescribe);
  EXPECT_EQ(ChoosePath(kRdmaHost, Peer("10.0.0.5"), GpuHost()).action, Action::kDescribe);
  EXPECT_EQ(ChoosePath(kTcpHost, Peer("10.0.0.5"), GpuHost()).action, Action::kOneRoundTrip);
}

TEST(ChoosePath, CudaIpcIsNeverAFallbackForAPeerElsewhere) {
  // A peer on another host whose primary is sim, and that lacks verbs.
  PeerFacts peer = Peer("10.0.0.6");
  peer.primary = "sim";
  peer.lacks.insert(kVerbs);
  PathStep s = ChoosePath(kRdmaGpuHost, peer, GpuHost());
  EXPECT_EQ(s.action, Action::kConnect);
  EXPECT_EQ(s.kind, kTcp);
  peer.lacks.insert(kTcp);
  s = ChoosePath(kRdmaGpuHost, peer, GpuHost());
  EXPECT_EQ(s.action, Action::kFail);
  EXPECT_EQ(s.error.code(), absl::StatusCode::kFailedPrecondition) << s.error;
}

TEST(ChoosePath, ATcpOnlyEngineTriesOneRoundTripThenDescribes) {
  PeerFacts peer = Peer("10.0.0.6");
  PathStep s = ChoosePath(kTcpHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kOneRoundTrip);
  EXPECT_EQ(s.kind, kTcp);
  EXPECT_EQ(s.why, "this engine has only tcp; the peer has it too");
  peer.one_round_trip_tried = true;
  EXPECT_EQ(ChoosePath(kTcpHost, peer, HostFacts()).action, Action::kDescribe);
  // Even on a GPU host: with TCP alone there is nothing else to choose.
  EXPECT_EQ(ChoosePath(kTcpHost, Peer("127.0.0.1"), GpuHost()).action, Action::kOneRoundTrip);
}

TEST(ChoosePath, TheSamePrimaryFirstAndTheFallbackAfterItFails) {
  PeerFacts peer = Peer("10.0.0.6");
  peer.primary = kVerbs;
  PathStep s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kConnect);
  EXPECT_EQ(s.via, 0u);
  EXPECT_EQ(s.why, "both ends have verbs");
  peer.failed.emplace_back(kVerbs, absl::UnavailableError("no route"));
  s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kConnect);
  EXPECT_EQ(s.via, 1u);
  EXPECT_EQ(s.why, "verbs links to the peer failed (no route); fell back to tcp");
  // The fallback failing too ends it with the fallback's error.
  peer.failed.emplace_back(kTcp, absl::DeadlineExceededError("tcp timed out"));
  s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kFail);
  EXPECT_EQ(s.error.message(), "tcp timed out");
  // A fallback the peer lacks: the primary's error.
  peer.failed.pop_back();
  peer.lacks.insert(kTcp);
  s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kFail);
  EXPECT_EQ(s.error.code(), absl::StatusCode::kUnavailable);
  // One transport: its failure is the answer.
  PeerFacts single = Peer("10.0.0.6");
  single.primary = kTcp;
  single.one_round_trip_tried = true;
  single.failed.emplace_back(kTcp, absl::UnavailableError("refused"));
  EXPECT_EQ(ChoosePath(kTcpHost, single, HostFacts()).error.message(), "refused");
}

TEST(ChoosePath, AnotherPrimaryGoesOverATransportBothHave) {
  PeerFacts peer = Peer("10.0.0.6");
  peer.primary = kTcp;  // a TCP-only peer of an RDMA engine
  PathStep s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kConnect);
  EXPECT_EQ(s.kind, kVerbs);  // asked for first: the peer may have it beside TCP
  peer.lacks.insert(kVerbs);
  s = ChoosePath(kRdmaHost, peer, HostFacts());
  EXPECT_EQ(s.action, Action::kConnect);
  EXPECT_EQ(s.via, 1u);
  EXPECT_EQ(s.why, "the peer's primary transport is tcp; both ends have tcp");
  // Nothing in common: says what each end has.
  PeerFacts sim = Peer("n7");
  sim.address = "n7:15000";
  sim.primary = "sim";
  sim.one_round_trip_tried = true;
  sim.lacks.insert(kTcp);
  s = ChoosePath(kTcpHost, sim, HostFacts());
  EXPECT_EQ(s.action, Action::kFail);
  EXPECT_EQ(s.error.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.error.message(), "peer n7:15000 uses the sim transport; this engine has tcp");
  EXPECT_EQ(ChoosePath({}, sim, HostFacts()).action, Action::kFail);
}

}  // namespace
}  // namespace engine_internal
}  // namespace kvferry
