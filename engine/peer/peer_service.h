// The engine's side of the peer protocol that answers: describes this
// engine, accepts links, takes notifications, answers probes and metadata
// requests. Runs on the handshake server's threads. Its own state: the links
// each peer instance opened here (to close them on a fence or a
// close-links request) and the fenced instances; what it answers from
// (transports, regions, inbox, metadata) belongs to the engine and outlives
// it.
#ifndef KVFERRY_ENGINE_PEER_PEER_SERVICE_H_
#define KVFERRY_ENGINE_PEER_PEER_SERVICE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/recent_set.h"
#include "engine/memory/local_regions.h"
#include "engine/peer/notifications.h"
#include "handshake/hand_over.h"
#include "handshake/messages.h"
#include "handshake/network.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

class PeerService {
 public:
  // `transports`: the primary first (LocalRegions' order).
  PeerService(uint64_t engine_id, std::vector<transport::Transport*> transports,
              const LocalRegions* regions, Inbox* inbox, const MetadataStore* metadata,
              const SentLog* sent)
      : engine_id_(engine_id),
        transports_(std::move(transports)),
        regions_(regions),
        inbox_(inbox),
        metadata_(metadata),
        sent_(sent) {}

  // This engine as peers see it through the transport of `kind` (empty:
  // the primary): NICs and the regions they may use. kNotFound when this
  // engine has no such transport.
  absl::StatusOr<handshake::EngineDescriptor> Describe(absl::string_view kind) const;
  // Whether answering a request of `type` may wait: closing links waits
  // for their threads, accepting links waits where a transport's AcceptLink
  // may (`accept_waits`, see transport::Limits). The others answer at once,
  // and the handshake server runs them on its event loop.
  static bool MayBlock(handshake::MessageType type, bool accept_waits) {
    const bool accept = type == handshake::MessageType::kConnect ||
                        type == handshake::MessageType::kConnectLinks ||
                        type == handshake::MessageType::kConnectLinksHere;
    return (accept && accept_waits) || type == handshake::MessageType::kCloseLinks;
  }
  // Answers one request (an error frame for anything malformed). The
  // answer to a kConnectLinksHere whose first link was accepted by a
  // transport with stream links hands the connection to that link
  // (handshake::HandOver); a network that cannot hand over keeps it.
  handshake::Answer Handle(const handshake::Frame& request);

  // Fences the peer instance `engine_id` (declared failed) at its current
  // epoch: closes every link it opened to this engine, and refuses its
  // links and notifications of that epoch or an earlier one from then on
  // (handshake::FencedError names the epoch). Returns once nothing it sent
  // on those links can land in this engine's memory (the transports'
  // CloseLink). The instance, if it is alive, learns the epoch from the
  // refusal, fails what it had in flight here, and comes back at a later
  // epoch (handshake::ConnectRequest::epoch): its new links and
  // notifications are taken. Idempotent while it stays at that epoch.
  // Logged (once per epoch) with `reason`, and counted.
  void Fence(uint64_t engine_id, absl::string_view reason);
  uint64_t fences() const;
  // Closes the links `engine_id` opened (without fencing it); with a
  // `source`, only those asked for from that address; only those of
  // `up_to_epoch` or an earlier epoch.
  void CloseLinksOf(uint64_t engine_id, absl::string_view source = "",
                    uint64_t up_to_epoch = UINT64_MAX);
  bool HasLinksOf(uint64_t engine_id, absl::string_view source) const;
  // Messages received so far on the links `engine_id` opened (the
  // transports' InputCount): growth means it is alive.
  uint64_t InputsFrom(uint64_t engine_id) const;
  // Whether `engine_id` is fenced at the latest epoch it used here.
  bool Fenced(uint64_t engine_id) const;

 private:
  // A link a peer opened, and the parameters this engine answered for it
  // (the name kCloseLinks uses).
  struct Tracked {
    transport::Transport* transport;
    transport::LinkId link;
    std::string params;
    std::string source;  // the address it was asked for from (RequestSource)
    uint64_t epoch = 0;  // the requester's (ConnectRequest::epoch)
  };

  // One link: the accepting transport's parameters.
  absl::StatusOr<std::string> Accept(const handshake::ConnectRequest& c);
  // The same, with the link (tracked as the requester's).
  absl::StatusOr<Tracked> AcceptLink(const handshake::ConnectRequest& c);
  handshake::Frame Connect(const handshake::Frame& request);
  handshake::Answer ConnectLinks(const handshake::Frame& request);
  handshake::Frame Notify(const handshake::Frame& request);
  // Closes the named links of the requesting engine (kCloseLinks).
  handshake::Frame CloseLinks(const handshake::Frame& request);
  // The refusal for `engine_id` at `epoch`, if it is fenced there.
  absl::Status RefuseFenced(uint64_t engine_id, uint64_t epoch) const;
  absl::Status RefuseFencedLocked(uint64_t engine_id, uint64_t epoch) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Notes that `engine_id` used `epoch` here.
  void SawEpoch(uint64_t engine_id, uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers that `engine_id` opened `link`; closes it at once (and says
  // so) if that engine was fenced at the link's epoch meanwhile.
  absl::Status Track(uint64_t engine_id, Tracked link);
  void PruneClosedLinks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the links of `links` their transports closed.
  static void DropClosed(std::vector<Tracked>& links);

  // Tracked links are pruned of closed ones when their count passes this.
  static constexpr size_t kPruneAbove = 4096;

 public:
  // Links (established, or accepted and waiting for their data connection)
  // that the peers at one address may hold: one source cannot take every
  // link slot (TCP has 512, two threads each) or pending claim of the
  // transports. More are refused with kResourceExhausted.
  static constexpr size_t kMaxLinksPerSource = 128;

 private:
  // Instances whose epochs are remembered (the oldest forgotten first).
  static constexpr size_t kMaxFenced = 65536;

  const uint64_t engine_id_;
  const std::vector<transport::Transport*> transports_;
  const LocalRegions* const regions_;
  Inbox* const inbox_;
  const MetadataStore* const metadata_;
  const SentLog* const sent_;  // what kConfirm answers from

  mutable Mutex mu_;
  std::map<uint64_t, std::vector<Tracked>> links_by_engine_ ABSL_GUARDED_BY(mu_);
  size_t tracked_ ABSL_GUARDED_BY(mu_) = 0;
  size_t prune_at_ ABSL_GUARDED_BY(mu_) = kPruneAbove;
  // Fenced instances: refused at this epoch and below. Only this engine's
  // own fences fill it.
  RecentMap<uint64_t, uint64_t> fenced_ ABSL_GUARDED_BY(mu_){kMaxFenced};
  // The highest epoch above 0 each instance used here (a link request or a
  // notification), for the next fence of it to cover. Anyone may fill it:
  // a forgotten entry only leaves a fence to the epochs of its links.
  RecentMap<uint64_t, uint64_t> highest_epoch_ ABSL_GUARDED_BY(mu_){kMaxFenced};
  // Each source's links, pruned of closed ones when it reaches its share.
  std::map<std::string, std::vector<Tracked>, std::less<>> by_source_ ABSL_GUARDED_BY(mu_);
  uint64_t fences_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PEER_PEER_SERVICE_H_
