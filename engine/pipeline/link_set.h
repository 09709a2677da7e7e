// The links of one segment (peer): building them through the handshake, and
// choosing the link for each slice (near NICs first, then the least loaded
// link relative to its speed).
#ifndef KVFERRY_ENGINE_PIPELINE_LINK_SET_H_
#define KVFERRY_ENGINE_PIPELINE_LINK_SET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/memory/local_regions.h"
#include "engine/peer/peer_client.h"
#include "handshake/messages.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// A link's load, shared by every copy of the link (the segment's and the
// views that submitting threads read without the pipeline's lock, see
// lanes.h): changed with atomic operations only. Padded to a cache line of
// its own: each thread tends to keep to one link (ChooseLink's `start`),
// and two threads' links must not share a line.
struct LinkLoad {
  char before[64];
  std::atomic<uint32_t> inflight{0};  // slices posted and not yet completed
  // Last sign of life: a completion, or the post that made it busy (Unix ns).
  std::atomic<int64_t> progress_ns{0};
  char after[64];

  // Takes one place if fewer than `capacity` are in flight (one atomic
  // operation when there is room).
  bool TryTake(uint32_t capacity, absl::Time now) {
    const uint32_t n = inflight.fetch_add(1, std::memory_order_relaxed);
    if (n >= capacity) {
      inflight.fetch_sub(1, std::memory_order_relaxed);
      return false;
    }
    if (n == 0) progress_ns.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
    return true;
  }
  // Gives `n` back (never more than are taken).
  void Give(absl::Time now, uint32_t n = 1) {
    const uint32_t had = inflight.fetch_sub(n, std::memory_order_relaxed);
    if (had < n) inflight.fetch_add(n - had, std::memory_order_relaxed);
    progress_ns.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
  }
};

struct Link {
  transport::LinkId id = 0;
  transport::NicIndex local_nic = 0;
  transport::NicIndex remote_nic = 0;
  // Relative speed: the slower NIC's rate in Mb/s, 1 when unknown.
  uint64_t weight = 1;
  bool failed = false;     // an error completion came: no new slices
  absl::Time failed_at;    // when it failed (its NIC pair is tried again later)
  bool repairing = false;  // a new link for its NIC pair is being built
  std::shared_ptr<LinkLoad> load = std::make_shared<LinkLoad>();
  uint32_t inflight() const { return load->inflight.load(std::memory_order_relaxed); }
  absl::Time progress() const {
    return absl::FromUnixNanos(load->progress_ns.load(std::memory_order_relaxed));
  }
  void set_progress(absl::Time t) {
    load->progress_ns.store(absl::ToUnixNanos(t), std::memory_order_relaxed);
  }
  // What the peer answered when it accepted the link: its name there
  // (handshake kCloseLinks).
  std::string peer_params;
  // The peer closed its half (after the link failed): nothing posted on it
  // can land any more.
  bool peer_closed = false;
  // This engine's epoch with the peer when the link was asked for
  // (PeerClient::EpochWith); a repair asks at the same epoch.
  uint64_t epoch = 0;
};

// Builds links to the engine at `peer` described by `d`: at least
// `links_per_peer`, and one per local NIC. A NIC pair that fails is skipped
// (logged) while others work; an unreachable peer fails the whole set.
absl::StatusOr<std::vector<Link>> ConnectLinks(transport::Transport* transport,
                                               const PeerClient& client, uint64_t engine_id,
                                               const std::string& peer,
                                               const handshake::EngineDescriptor& d,
                                               uint32_t links_per_peer, absl::Time now);

// The peer's descriptor for `kind` and links to it, in one handshake round
// trip: for a transport with one NIC whose links can be offered before the
// peer is described (transport::StreamLinks::OfferLink), the offers travel with the
// request for the descriptor, and each link connects once the descriptor is
// in. kUnimplemented when the transport cannot offer early (or has several
// NICs); `links` is kUnimplemented when the peer's descriptor is not one
// NIC of `kind` or the peer refuses connect-links (the caller builds links
// the usual way then); any other error as ConnectLinks.
struct DescribedLinks {
  handshake::EngineDescriptor descriptor;
  absl::StatusOr<std::vector<Link>> links = absl::UnimplementedError("not offered");
};
absl::StatusOr<DescribedLinks> DescribeWithLinks(transport::Transport* transport,
                                                 const PeerClient& client, uint64_t engine_id,
                                                 const std::string& peer, const std::string& kind,
                                                 uint32_t links_per_peer, absl::Time now);

// One link from `link.local_nic` to the peer's `link.remote_nic`, asked for
// at `link.epoch` (the other fields of `link` are kept); kUnavailable etc. from the handshake or
// the transport, nothing left open on failure.
absl::StatusOr<Link> ConnectLink(transport::Transport* transport, const PeerClient& client,
                                 uint64_t engine_id, const std::string& peer,
                                 const transport::NicInfo& local_nic_info,
                                 const transport::NicInfo& peer_nic_info, Link link);

// The link a slice should go on: among links that are not failed and have
// fewer than `capacity` slices in flight, the one with the fewest in flight
// per unit of speed, on a NIC in `near` if any has room (near 0: any NIC);
// ties go to the first from link `start` on (each submitting thread starts
// at its own, so that threads keep to different links). An idle near link
// ends the search (none can be less loaded): a thread whose own link is
// idle reads no other thread's. Takes a place on it (LinkLoad::TryTake);
// null when every link is full or failed.
const Link* ChooseLink(const std::vector<Link>& links, NicMask near, uint32_t capacity,
                       size_t start, absl::Time now);

// Links for the slices of a batch at once: each slice's link chosen as
// ChooseLink chooses, against loads counted here, then every place taken
// with one atomic add per link (Take) instead of one per slice.
class LinkPlan {
 public:
  static constexpr size_t kMaxLinks = 16;
  // False when the links are more than a plan holds (ChooseLink then).
  bool Begin(const std::vector<Link>* links, uint32_t capacity, size_t start);
  // The index of the next slice's link, or -1 when every link is full or
  // failed (as far as the plan knows).
  int Next(NicMask near);
  // Takes the places planned; false (nothing taken) when other threads
  // took some meanwhile and a link would go over its capacity.
  bool Take(absl::Time now);
  // How many the plan put on link i (after Begin).
  uint32_t added(size_t i) const { return added_[i]; }

 private:
  const std::vector<Link>* links_ = nullptr;
  uint32_t capacity_ = 0;
  size_t start_ = 0;
  static constexpr uint32_t kUnread = UINT32_MAX;
  uint32_t load_[kMaxLinks];   // as read (kUnread: not yet), plus the plan's
  uint32_t added_[kMaxLinks];  // the plan's
};

// Takes counts[i] places on links[i] for each i (n of them, at most the
// links there are), or none: false when one would go over `capacity`.
bool TakePlaces(const std::vector<Link>& links, const uint32_t* counts, size_t n, uint32_t capacity,
                absl::Time now);

// Places given back to links, one atomic operation per link: completions
// of one link come in runs.
class LoadReturns {
 public:
  void Add(LinkLoad* load, absl::Time now) {
    for (size_t i = 0; i < n_; ++i) {
      if (loads_[i] == load) {
        ++counts_[i];
        return;
      }
    }
    if (n_ == kMax) {
      load->Give(now);
      return;
    }
    loads_[n_] = load;
    counts_[n_++] = 1;
  }
  void Flush(absl::Time now) {
    for (size_t i = 0; i < n_; ++i) loads_[i]->Give(now, counts_[i]);
    n_ = 0;
  }

 private:
  static constexpr size_t kMax = 8;
  LinkLoad* loads_[kMax];
  uint32_t counts_[kMax];
  size_t n_ = 0;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PIPELINE_LINK_SET_H_
