// For tests that run on verbs where a host has RDMA (inside
// tools/softroce/vm.sh) and skip elsewhere: the ports discovery selects on
// this host, or why there are none.
#ifndef KVFERRY_TRANSPORT_VERBS_TEST_PORTS_H_
#define KVFERRY_TRANSPORT_VERBS_TEST_PORTS_H_

#include <string>
#include <vector>

#include "transport/verbs/discovery.h"

namespace kvferry {
namespace transport {
namespace verbs {

class TestPorts {
 public:
  // Runs discovery (with MC_GID_INDEX and the like applied).
  TestPorts();
  const std::vector<SelectedPort>& ports() const { return ports_; }
  // Empty when there is a port; else why there is none. With
  // KVFERRY_REQUIRE_RDMA=1 a missing port is also a test failure.
  std::string SkipReason() const;

 private:
  std::vector<SelectedPort> ports_;
  std::string skip_;
};

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_TEST_PORTS_H_
