#include "transport/verbs/test_ports.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace verbs {

TestPorts::TestPorts() {
  DiscoveryOptions o;
  ApplyEnvironment(&o);
  absl::StatusOr<Discovery> d = Discover(o);
  if (d.ok()) ports_ = d->selected;
  if (ports_.empty()) {
    skip_ = d.ok() ? "no active RDMA port on this host (run inside tools/softroce/vm.sh)"
                   : std::string(d.status().message());
  }
}

std::string TestPorts::SkipReason() const {
  const char* require = std::getenv("KVFERRY_REQUIRE_RDMA");
  if (!skip_.empty() && require != nullptr && std::string(require) == "1") {
    ADD_FAILURE() << "KVFERRY_REQUIRE_RDMA=1 but: " << skip_;
  }
  return skip_;
}

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry
