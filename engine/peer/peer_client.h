// The engine's side of the peer protocol as typed calls: each sends one
// request over the handshake network and checks the reply's type and
// payload once, so callers see either a decoded answer or a Status that
// names the peer.
#ifndef KVFERRY_ENGINE_PEER_PEER_CLIENT_H_
#define KVFERRY_ENGINE_PEER_PEER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/recent_set.h"
#include "handshake/hand_over.h"
#include "handshake/messages.h"
#include "handshake/network.h"

namespace kvferry {
namespace engine_internal {

class PeerClient {
 public:
  // `network` outlives the client; `timeout` bounds each call but Probe.
  PeerClient(handshake::Network* network, uint64_t engine_id, absl::Duration timeout)
      : network_(network),
        hand_over_(handshake::ExtensionOf<handshake::HandOver>(network)),
        engine_id_(engine_id),
        timeout_(timeout) {}

  // The peer's descriptor for its transport of `kind` (empty: its primary),
  // regions sorted by address, with the peer's protocol version and
  // capabilities. A version 1 peer, which refuses kDescribeV2 as an unknown
  // type, is described with kDescribe: its capabilities are unknown.
  absl::StatusOr<handshake::EngineDescriptor> Describe(const std::string& peer,
                                                       const std::string& kind = "") const;
  // Asks the peer to accept a link; returns its link parameters.
  absl::StatusOr<std::string> Connect(const std::string& peer,
                                      const handshake::ConnectRequest& request) const;
  // Several links in one round trip: one answer per request, in order.
  // `capabilities`: the peer's (its descriptor's). A peer without
  // kCapConnectLinks is asked one link at a time; one that states nothing
  // (version 1) is asked in one round trip first, and one link at a time
  // when it refuses the type (its refusal is the only sign).
  using LinkAnswers = std::vector<absl::StatusOr<std::string>>;
  absl::StatusOr<LinkAnswers> ConnectLinks(const std::string& peer,
                                           std::vector<handshake::ConnectRequest> requests,
                                           std::optional<uint64_t> capabilities) const;
  // Describe(peer, kind) and kConnectLinks for links offered before the
  // description, pipelined: one round trip where the network can. Once the
  // descriptor is in, `on_descriptor` runs before the links' answers are
  // read (the requester connects the links there); returning false leaves
  // them unread (`links` is kAborted then). kUnimplemented from a version 1
  // peer (it refuses kDescribeV2): the caller asks the usual way.
  //
  // With `ride`, where the network can hand its connections over
  // (handshake::HandOver), the
  // first link rides the call's own connection (kConnectLinksHere): once
  // the reply accepts that link, `ride` takes the connection (the peer's
  // end is that link's by then), and what it returns becomes the first
  // link's answer. The requester then connects only the other links.
  struct Described {
    handshake::EngineDescriptor descriptor;
    absl::StatusOr<LinkAnswers> links = absl::AbortedError("not asked");
  };
  using Ride = std::function<absl::Status(net::Fd connection)>;
  absl::StatusOr<Described> DescribeAndConnect(
      const std::string& peer, const std::string& kind,
      std::vector<handshake::ConnectRequest> requests,
      absl::FunctionRef<bool(const handshake::EngineDescriptor&)> on_descriptor,
      const Ride& ride = nullptr) const;
  // Whether DescribeAndConnect's first link can ride the call's connection.
  bool CanRide() const { return hand_over_ != nullptr; }
  // Asks the peer to close its halves of links this engine opened, named by
  // the parameters it answered for them (at most kMaxLinksPerConnect). OK
  // once they are closed; OK too, without asking, from a peer without
  // kCapCloseLinks (it cannot be asked), and from a version 1 peer
  // (`capabilities` nullopt) that refuses the type.
  absl::Status CloseLinks(const std::string& peer, std::vector<std::string> links,
                          std::optional<uint64_t> capabilities) const;
  // The engine id that answers at `peer` within `timeout`.
  absl::StatusOr<uint64_t> Probe(const std::string& peer, absl::Duration timeout) const;
  // Whether the engine answering at `peer` sent a notification of
  // `digest` lately, and which engine answered.
  absl::StatusOr<handshake::ConfirmReply> Confirm(const std::string& peer, uint64_t digest,
                                                  absl::Duration timeout) const;
  // Delivers a notification, refused by any instance but `target` (0: any).
  // Waits up to `timeout` (0: the client's).
  absl::Status Notify(const std::string& peer, const std::string& message, uint64_t target,
                      absl::Duration timeout = {}) const;
  // This engine's epoch with the engine at `peer` (ConnectRequest::epoch):
  // 0 until that engine fenced this one, then one past the epoch its
  // refusal named (handshake::FencedEpoch), which every call here that the
  // peer refuses so teaches. Link requests carry it as their caller puts
  // it (the pipeline reads it once per set of links), notifications as it
  // is when they are sent.
  uint64_t EpochWith(const std::string& peer) const ABSL_LOCKS_EXCLUDED(epochs_mu_);
  // Called (on the thread whose call was refused, no lock held) each time
  // a peer's refusal moves this engine's epoch with it to `epoch`: the
  // pipeline marks that peer's segment for a refresh, so that its links
  // are rebuilt at the new epoch at once (over verbs nothing else would
  // tell it the peer closed them). Set once, before any call.
  using FenceListener = std::function<void(const std::string& peer, uint64_t epoch)>;
  void OnFenced(FenceListener listener) { on_fenced_ = std::move(listener); }
  // A value the peer published, and the instance that answered.
  // Waits up to `timeout` (0: the client's).
  absl::StatusOr<handshake::Metadata> GetMetadata(const std::string& peer, const std::string& key,
                                                  absl::Duration timeout = {}) const;

 private:
  // Sends `request` and checks the reply is of type `expected`.
  absl::StatusOr<handshake::Frame> Call(const std::string& peer, handshake::Frame request,
                                        handshake::MessageType expected,
                                        absl::Duration timeout) const;
  // A reply's type checked against what `sent` expects (kDataLoss if not).
  static absl::StatusOr<handshake::Frame> Expect(const std::string& peer,
                                                 handshake::MessageType sent,
                                                 absl::StatusOr<handshake::Frame> reply,
                                                 handshake::MessageType expected);
  // Whether `status`, a peer's answer to a message type, may be a version
  // 1 peer's refusal of a type it does not know.
  static bool RefusedAsUnknown(const absl::Status& status);
  // A kDescriptor's or kDescriptorV2's payload, regions sorted.
  static absl::StatusOr<handshake::EngineDescriptor> DecodeDescriptor(
      const handshake::Frame& reply);
  static absl::StatusOr<LinkAnswers> DecodeLinks(const std::string& peer,
                                                 const handshake::Frame& reply, size_t count);
  // Takes the epoch after the one that a fence refusal from `peer` names
  // (nothing for any other status).
  void Learn(const std::string& peer, const absl::Status& status) const
      ABSL_LOCKS_EXCLUDED(epochs_mu_);
  // The same for every refused link of a connect-links answer (or the call).
  void LearnFrom(const std::string& peer, const absl::StatusOr<LinkAnswers>& answers) const
      ABSL_LOCKS_EXCLUDED(epochs_mu_);
  template <typename T>
  const absl::StatusOr<T>& Learned(const std::string& peer, const absl::StatusOr<T>& s) const {
    if (!s.ok()) Learn(peer, s.status());
    return s;
  }

  // Peers whose epochs are remembered (the oldest forgotten first: it is
  // refused once more, and learns its epoch again).
  static constexpr size_t kMaxEpochs = 4096;

  handshake::Network* const network_;
  handshake::HandOver* const hand_over_;  // null: the network cannot hand over
  const uint64_t engine_id_;
  const absl::Duration timeout_;
  FenceListener on_fenced_;
  mutable Mutex epochs_mu_;
  mutable RecentMap<std::string, uint64_t> epochs_ ABSL_GUARDED_BY(epochs_mu_){kMaxEpochs};
};

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PEER_PEER_CLIENT_H_
