// How a KvReceiver judges the prefills that expected requests come from:
// what it knows of each (PrefillState), probing the due ones at once
// (ProbeAll), and whether a probe's result means death (DeathOf, a pure
// function of the facts). The receiver (kv_receiver_watch.cc) keeps the
// states, fences the dead and fails their requests.
#ifndef KVFERRY_KV_PREFILL_PROBE_H_
#define KVFERRY_KV_PREFILL_PROBE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/transfer_engine.h"
#include "net/socket.h"

namespace kvferry {
namespace kv_internal {

// A prefill that expected requests come from.
struct PrefillState {
  uint64_t engine_id = 0;  // as its first probe answered, or Expect named (0: not yet)
  // The prefill at that address presented engine_id itself (a probe's
  // answer): only such an id is ever fenced.
  bool presented = false;
  absl::Time last_answer;  // or when it was first expected
  absl::Time next_probe;
  uint32_t expected = 0;  // pending requests expected from it (> 0)
  // Messages received on its data links so far (DataInputsFrom): growth
  // since the last probe means alive, whatever the probe said.
  uint64_t inputs = 0;
  // Its watch connection closed: probes that fail without an answer are
  // retried after kQuickRetry, this many more times, not a period later.
  // (A process being killed closes its sockets one by one: the probe that
  // the closed watch set off may meet the listener still open and be
  // reset, a moment before the port refuses.)
  uint32_t quick_retries = 0;
};
inline constexpr uint32_t kQuickRetries = 5;
inline constexpr absl::Duration kQuickRetry = absl::Milliseconds(10);

// One prefill's probe: when it ran, its answer, and a watch connection
// opened after it answered (if it had none).
struct Probe {
  absl::Time start, end;
  absl::StatusOr<uint64_t> id = absl::UnknownError("not probed");
  bool watched = false;  // it has a watch connection
  net::Fd watch;         // one opened now
};

// Prefills probed at once at most (the calling thread and helpers).
inline constexpr size_t kMaxProbesAtOnce = 16;

// Probes the prefills at `peers` (handshake addresses) with `engine`, all
// at once (up to kMaxProbesAtOnce threads, so that many frozen ones, each
// waiting out `period`, do not push the others past their bound), each
// within `period`. `watched[i]`: peers[i] has a watch connection already;
// with the real clock one is opened to each other peer that answered.
std::vector<Probe> ProbeAll(TransferEngine& engine, absl::Span<const std::string> peers,
                            const std::vector<bool>& watched, absl::Duration period);

// Why the prefill `p` at `peer` counts as dead after probe result `id`
// ending at `now` (OK when it does not): it restarted (another engine id),
// its port refuses, or it answered nothing for peer_timeout less a period
// while its data links (`data_moved`) were quiet too.
absl::Status DeathOf(const std::string& peer, const PrefillState& p,
                     const absl::StatusOr<uint64_t>& id, absl::Time now, bool data_moved,
                     absl::Duration peer_timeout);

}  // namespace kv_internal
}  // namespace kvferry

#endif  // KVFERRY_KV_PREFILL_PROBE_H_
