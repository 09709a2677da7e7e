// Builds a link between two transports that live in the same process, doing
// the three link-setup steps the handshake normally carries between hosts.
// For loopback runs, tools and tests.
#ifndef KVFERRY_TRANSPORT_IN_PROCESS_H_
#define KVFERRY_TRANSPORT_IN_PROCESS_H_

#include <utility>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {

// Links NIC `na` of `a` to NIC `nb` of `b`. Returns {link on a, link on b};
// both ends are established. kInvalidArgument for a NIC index out of range.
absl::StatusOr<std::pair<LinkId, LinkId>> ConnectInProcess(Transport& a,
                                                           Transport& b,
                                                           NicIndex na = 0,
                                                           NicIndex nb = 0);

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_IN_PROCESS_H_
