#include "kv/prefill_probe.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/clock.h"
#include "base/thread.h"

namespace kvferry {
namespace kv_internal {

std::vector<Probe> ProbeAll(TransferEngine& engine, absl::Span<const std::string> peers,
                            const std::vector<bool>& watched, absl::Duration period) {
  Clock* clock = engine.clock();
  const bool real = clock == RealClock();
  std::vector<Probe> probes(peers.size());
  for (size_t i = 0; i < peers.size() && i < watched.size(); ++i) probes[i].watched = watched[i];
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < peers.size();) {
      probes[i].start = clock->Now();
      probes[i].id = engine.ProbePeer(peers[i], period);
      probes[i].end = clock->Now();
      if (probes[i].id.ok() && !probes[i].watched && real) {
        absl::StatusOr<net::HostPort> hp = net::ParseHostPort(peers[i]);
        absl::StatusOr<net::Fd> fd = hp.ok() ? net::Connect(*hp, period) : hp.status();
        if (fd.ok()) probes[i].watch = std::move(*fd);
      }
    }
  };
  std::vector<std::thread> helpers;
  const size_t threads = std::min(peers.size(), kMaxProbesAtOnce);
  for (size_t t = 1; t < threads && real; ++t) {
    absl::StatusOr<std::thread> helper = StartThread("a KV receiver's probe", work);
    if (!helper.ok()) break;  // fewer at once, never none: this thread probes too
    helpers.push_back(std::move(*helper));
  }
  work();
  for (std::thread& t : helpers) t.join();
  return probes;
}

absl::Status DeathOf(const std::string& peer, const PrefillState& p,
                     const absl::StatusOr<uint64_t>& id, absl::Time now, bool data_moved,
                     absl::Duration peer_timeout) {
  const absl::Duration period = peer_timeout / 4;
  // An instance fenced earlier that answers is alive: it comes back at a
  // later epoch (PeerService::Fence), and its new requests count.
  if (id.ok() && p.engine_id != 0 && *id != p.engine_id) {
    if (p.presented) {
      return absl::UnavailableError(absl::StrFormat(
          "the prefill at %s restarted (engine %#x, now %#x): its requests were lost", peer,
          p.engine_id, *id));
    }
    return absl::UnavailableError(absl::StrFormat(
        "the prefill at %s is not the engine named for its requests (%#x, it answers as %#x): "
        "it restarted, or the name was wrong",
        peer, p.engine_id, *id));
  }
  if (id.ok() || TransferEngine::PeerAnswered(id.status())) return absl::OkStatus();
  if (net::ConnectionRefused(id.status())) {
    // Nothing listens at its port: the process is gone (no need to wait).
    return absl::UnavailableError(absl::StrCat("the prefill at ", peer,
                                               " is gone: its port refuses connections (",
                                               id.status().message(), ")"));
  }
  if (!data_moved && now - p.last_answer >= peer_timeout - period) {
    return absl::UnavailableError(
        absl::StrCat("the prefill at ", peer, " has not answered for ",
                     absl::FormatDuration(absl::Trunc(now - p.last_answer, absl::Milliseconds(1))),
                     " (", id.status().message(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace kv_internal
}  // namespace kvferry
