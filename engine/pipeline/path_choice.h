// Which transport a peer's segment goes over, as a pure function: what this
// engine has, what is known of the peer so far, and facts about this host
// go in; the next step to take and why come out. The pipeline's segment
// registry runs the steps (describing the peer, connecting links) and feeds
// what it learns back in, until a step succeeds or the choice fails. No
// network, no CUDA driver, no clock: tests drive it with facts alone.
//
// The order of preference:
//   1. a peer on this host, from an engine with a CUDA driver and the
//      same-host transport (cuda_ipc, beside its primary): over cuda_ipc,
//      whose links copy device memory GPU to GPU, if the peer has it too;
//   2. an engine with TCP alone (and maybe cuda_ipc): the peer's TCP
//      descriptor and the links in one round trip (link_set.h,
//      DescribeWithLinks), where the transport can offer links early;
//   3. the peer's primary transport, if this engine's primary is of its
//      kind and the links come up;
//   4. another transport of this engine that the peer also has (a failed
//      primary falls back to it); never cuda_ipc, which is step 1's.
#ifndef KVFERRY_ENGINE_PIPELINE_PATH_CHOICE_H_
#define KVFERRY_ENGINE_PIPELINE_PATH_CHOICE_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "net/interfaces.h"

namespace kvferry {
namespace engine_internal {

// Facts about this host, read once when the engine is made.
struct HostFacts {
  // Whether a CUDA driver is loaded (device memory can be registered).
  bool cuda = false;
  // This host's interface addresses (a peer at one of them, or at
  // loopback, is on this host).
  std::vector<net::InterfaceAddress> addresses;
  // The facts of the host this process runs on.
  static HostFacts OfThisHost();
};

// What the registry learned about the peer so far.
struct PeerFacts {
  std::string address;                // "host:port", as the peer is named
  std::string host;                   // the same without the port
  std::string primary;                // its primary transport's kind; empty: not described yet
  bool same_host_tried = false;       // step 1 was taken, and failed
  bool one_round_trip_tried = false;  // step 2 was taken and could not be used
  // Kinds the peer does not have (it answered describe with another kind).
  absl::flat_hash_set<std::string> lacks;
  // Failures to connect links, in order, with the kind each was over. A
  // failed primary (step 3) falls back; any other failure is the answer.
  std::vector<std::pair<std::string, absl::Status>> failed;
};

struct PathStep {
  enum class Action {
    kConnect,       // describe the peer's `kind` (unless it is the primary) and connect
    kOneRoundTrip,  // step 2 over `via`
    kDescribe,      // ask for the peer's primary descriptor
    kFail,          // `error` is the answer
  };
  Action action = Action::kFail;
  size_t via = 0;    // index into this engine's transports
  std::string kind;  // the kind asked for (kConnect, kOneRoundTrip)
  std::string why;   // for the log and the peer's metrics, once it succeeds
  absl::Status error;
};

// The next step, for an engine whose transports are of kinds `mine` (the
// primary first).
PathStep ChoosePath(absl::Span<const std::string> mine, const PeerFacts& theirs,
                    const HostFacts& facts);

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_PATH_CHOICE_H_
