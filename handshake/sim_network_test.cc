#include "handshake/sim_network.h"

#include "gtest/gtest.h"
#include "sim/fabric.h"
#include "sim/scheduler.h"

namespace kvferry {
namespace handshake {
namespace {

struct Pair {
  explicit Pair(sim::FaultOptions faults = {}) : fabric(&sched, 9, faults) {
    a = *fabric.topology().AddNic(fabric.topology().AddNode("a"), {});
    b = *fabric.topology().AddNic(fabric.topology().AddNode("b"), {});
  }
  sim::Scheduler sched;
  sim::Fabric fabric;
  sim::NicId a, b;
};

TEST(SimNetwork, CallsAreAnsweredOnceEvenWhenMessagesAreLost) {
  sim::FaultOptions lossy;
  lossy.drop = {1, 3};
  Pair p(lossy);
  SimNetwork client(&p.fabric, p.a), server_net(&p.fabric, p.b);
  int handled = 0;
  auto server = server_net.Serve({}, [&](const Frame& f) {
    ++handled;
    return Frame{MessageType::kProbeReply, f.payload};
  });
  ASSERT_TRUE(server.ok());
  EXPECT_EQ((*server)->address(), server_net.host() + ":15000");
  for (int i = 0; i < 20; ++i) {
    auto reply =
        client.Call((*server)->address(), Frame{MessageType::kProbe, Encode(Probe{1, uint64_t(i)})},
                    absl::Milliseconds(50));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(DecodeProbe(reply->payload)->nonce, uint64_t(i));
  }
  EXPECT_EQ(handled, 20);  // resent requests were not handled twice
  EXPECT_GT(p.fabric.stats().dropped, 0u);
}

TEST(SimNetwork, RefusedUnreachableAndErrors) {
  Pair p;
  SimNetwork client(&p.fabric, p.a), server_net(&p.fabric, p.b);
  auto refused = client.Call(server_net.host() + ":15000", Frame{MessageType::kProbe, ""},
                             absl::Milliseconds(10));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("refused"), std::string::npos);
  auto server =
      server_net.Serve({}, [](const Frame&) { return ErrorFrame(absl::NotFoundError("nope")); });
  EXPECT_EQ(
      client.Call((*server)->address(), Frame{MessageType::kProbe, ""}, absl::Milliseconds(10))
          .status()
          .code(),
      absl::StatusCode::kNotFound);
  p.fabric.topology().SetNodeUp(1, false);
  const sim::SimTime start = p.sched.now();
  auto down =
      client.Call((*server)->address(), Frame{MessageType::kProbe, ""}, absl::Milliseconds(10));
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(p.sched.now() - start, sim::ToSimTime(absl::Milliseconds(10)));
  EXPECT_EQ(client.Call("10.0.0.1:5", Frame{}, absl::Milliseconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Two servers cannot share a port; a freed port can be served again.
  ServeOptions fixed;
  fixed.port = 15000;
  EXPECT_EQ(server_net.Serve(fixed, nullptr).status().code(), absl::StatusCode::kAlreadyExists);
  server->reset();
  EXPECT_TRUE(server_net.Serve(fixed, [](const Frame& f) { return f; }).ok());
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
