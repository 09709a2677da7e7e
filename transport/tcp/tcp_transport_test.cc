// TCP-specific behaviour beyond the conformance suite.
#include <dirent.h>

#include <memory>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/in_process.h"
#include "transport/tcp/tcp_transport.h"

namespace kvferry {
namespace transport {
namespace {

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

TEST(TcpTransport, PeersThatReconnectOftenLeakNoSockets) {
  TcpTransportOptions o;
  auto server = CreateTcpTransport(o);
  ASSERT_TRUE(server.ok());
  // Warm up once so lazily opened descriptors do not count.
  {
    auto client = CreateTcpTransport(o);
    ASSERT_TRUE(ConnectInProcess(**client, **server).ok());
  }
  const int before = OpenFds();
  for (int i = 0; i < 50; ++i) {
    auto client = CreateTcpTransport(o);
    ASSERT_TRUE(client.ok());
    ASSERT_TRUE(ConnectInProcess(**client, **server).ok());
    client->reset();                      // the peer goes away
    absl::SleepFor(absl::Milliseconds(2));  // its connection ends at the server
  }
  // The last few may still be ending; fifty would be a leak.
  EXPECT_LT(OpenFds() - before, 6);
}

TEST(TcpTransport, WildcardBindNeedsAnAdvertisedAddress) {
  TcpTransportOptions o;
  o.bind_host = "0.0.0.0";
  EXPECT_EQ(CreateTcpTransport(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.advertise_host = "127.0.0.1";
  auto t = CreateTcpTransport(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->LocalEndpoint().nics[0].address.rfind("127.0.0.1:", 0), 0u);
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
