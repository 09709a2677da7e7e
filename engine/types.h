// The engine's vocabulary: the types its API and every unit inside it speak
// (requests, batches and their status, notifications, counters). The lowest
// header of engine/: it includes nothing of the engine but its metrics.
#ifndef KVFERRY_ENGINE_TYPES_H_
#define KVFERRY_ENGINE_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/metrics/metrics.h"
#include "transport/transport.h"

namespace kvferry {

// One transfer: WRITE copies local -> peer, READ copies peer -> local.
struct TransferRequest {
  transport::Opcode opcode = transport::Opcode::kWrite;
  void* local = nullptr;  // inside memory registered on this engine
  uint64_t remote = 0;    // address in the peer's registered memory
  uint64_t length = 0;
};

using SegmentId = uint64_t;
using BatchId = uint64_t;

struct BatchStatus {
  size_t pending = 0;
  size_t succeeded = 0;
  size_t failed = 0;
  std::vector<absl::Status> requests;  // OK, the error, or kUnavailable("pending")
  bool done() const { return pending == 0; }
  bool ok() const { return pending == 0 && failed == 0; }
};

struct Notification {
  uint64_t engine_id = 0;  // the sender, as it claims
  std::string message;
  // The address (host, no port) it came from as this engine's network saw
  // it (not claimable); empty where the network does not know.
  std::string source;
};

// A region a peer advertises: where a request may write or read.
struct RemoteRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  transport::Access access = transport::Access::kNone;
};

// Events of the engine's life, for monitoring and tests.
struct EngineCounters {
  uint64_t handshakes_refused = 0;  // requests without the secret (auth.h)
  uint64_t reconnects = 0;          // segments whose links were rebuilt
  uint64_t link_failovers = 0;      // slices moved off a failed link
  uint64_t links_repaired = 0;      // failed links rebuilt on their NIC pair later
  uint64_t probes = 0;              // peers probed for silence
  uint64_t probes_failed = 0;       // ... that did not answer
  uint64_t peers_fenced = 0;        // peer instances fenced (FencePeer)
};

// What the engine posted on each of its NICs (see metrics.h).
using NicCounters = NicMetrics;

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_TYPES_H_
