#include "engine/peer/peer_service.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "handshake/auth.h"
#include "transport/link_params.h"
#include "transport/stream_links.h"

namespace kvferry {
namespace engine_internal {

using handshake::ErrorFrame;
using handshake::Frame;
using handshake::MessageType;

absl::StatusOr<handshake::EngineDescriptor> PeerService::Describe(absl::string_view kind) const {
  for (size_t i = 0; i < transports_.size(); ++i) {
    transport::EndpointDescription endpoint = transports_[i]->LocalEndpoint();
    if (!kind.empty() && endpoint.kind != kind) continue;
    handshake::EngineDescriptor d;
    d.engine_id = engine_id_;
    d.transport_kind = endpoint.kind;
    d.nics = std::move(endpoint.nics);
    d.regions = regions_->Advertised(i);
    return d;
  }
  return absl::NotFoundError(absl::StrCat("this engine has no ", kind, " transport"));
}

absl::Status PeerService::RefuseFenced(uint64_t engine_id, uint64_t epoch) const {
  MutexLock lock(&mu_);
  return RefuseFencedLocked(engine_id, epoch);
}

absl::Status PeerService::RefuseFencedLocked(uint64_t engine_id, uint64_t epoch) const {
  const uint64_t* fenced_at = fenced_.Find(engine_id);
  if (fenced_at == nullptr || epoch > *fenced_at) return absl::OkStatus();
  return handshake::FencedError(
      absl::StrFormat("engine %#x was declared failed by engine %#x, which refuses its links and "
                      "notifications of that time (what it had in flight here is lost; it may "
                      "come back at a later epoch)",
                      engine_id, engine_id_),
      *fenced_at);
}

void PeerService::SawEpoch(uint64_t engine_id, uint64_t epoch) {
  if (epoch == 0) return;  // the common case: nothing kept
  uint64_t& highest = highest_epoch_[engine_id];
  highest = std::max(highest, epoch);
}

bool PeerService::Fenced(uint64_t engine_id) const {
  MutexLock lock(&mu_);
  const uint64_t* fenced_at = fenced_.Find(engine_id);
  const uint64_t* highest = highest_epoch_.Find(engine_id);
  return fenced_at != nullptr && (highest == nullptr || *highest <= *fenced_at);
}

absl::Status PeerService::Track(uint64_t engine_id, Tracked link) {
  {
    MutexLock lock(&mu_);
    absl::Status refused = RefuseFencedLocked(engine_id, link.epoch);
    if (refused.ok()) {
      SawEpoch(engine_id, link.epoch);
      links_by_engine_[engine_id].push_back(std::move(link));
      if (++tracked_ > prune_at_) PruneClosedLinks();
      return absl::OkStatus();
    }
  }
  // Fenced while its link was being accepted.
  (void)link.transport->CloseLink(link.link);
  return RefuseFenced(engine_id, link.epoch);
}

void PeerService::DropClosed(std::vector<Tracked>& links) {
  links.erase(std::remove_if(links.begin(), links.end(),
                             [](const Tracked& l) { return !l.transport->HasLink(l.link); }),
              links.end());
}

// Forgets links that are gone (their peers closed them): what stays is
// bounded by the transports' link caps.
void PeerService::PruneClosedLinks() {
  tracked_ = 0;
  for (auto it = links_by_engine_.begin(); it != links_by_engine_.end();) {
    auto& v = it->second;
    DropClosed(v);
    tracked_ += v.size();
    it = v.empty() ? links_by_engine_.erase(it) : std::next(it);
  }
  for (auto it = by_source_.begin(); it != by_source_.end();) {
    DropClosed(it->second);
    it = it->second.empty() ? by_source_.erase(it) : std::next(it);
  }
  prune_at_ = std::max(kPruneAbove, 2 * tracked_);
}

void PeerService::Fence(uint64_t engine_id, absl::string_view reason) {
  // Its links are all of its highest epoch here or earlier ones.
  uint64_t epoch = 0;
  {
    MutexLock lock(&mu_);
    const uint64_t* before = fenced_.Find(engine_id);
    if (before != nullptr) epoch = *before;
    if (const uint64_t* highest = highest_epoch_.Find(engine_id)) epoch = std::max(epoch, *highest);
    if (auto it = links_by_engine_.find(engine_id); it != links_by_engine_.end()) {
      for (const Tracked& l : it->second) epoch = std::max(epoch, l.epoch);
    }
    if (before == nullptr || *before < epoch) {
      ++fences_;
      KVF_LOG(WARNING) << absl::StrFormat("fencing engine %#x (epoch %d) off this engine (%#x): ",
                                          engine_id, epoch, engine_id_)
                       << (reason.empty() ? "declared failed" : reason);
    }
    fenced_[engine_id] = epoch;
  }
  CloseLinksOf(engine_id, "", epoch);
}

uint64_t PeerService::fences() const {
  MutexLock lock(&mu_);
  return fences_;
}

bool PeerService::HasLinksOf(uint64_t engine_id, absl::string_view source) const {
  MutexLock lock(&mu_);
  auto it = links_by_engine_.find(engine_id);
  if (it == links_by_engine_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(), [&](const Tracked& l) {
    return (source.empty() || l.source == source) && l.transport->HasLink(l.link);
  });
}

uint64_t PeerService::InputsFrom(uint64_t engine_id) const {
  MutexLock lock(&mu_);
  auto it = links_by_engine_.find(engine_id);
  uint64_t n = 0;
  if (it != links_by_engine_.end()) {
    for (const Tracked& l : it->second) n += l.transport->InputCount(l.link);
  }
  return n;
}

void PeerService::CloseLinksOf(uint64_t engine_id, absl::string_view source, uint64_t up_to_epoch) {
  std::vector<Tracked> links;
  {
    MutexLock lock(&mu_);
    auto it = links_by_engine_.find(engine_id);
    if (it != links_by_engine_.end()) {
      auto& v = it->second;
      auto doomed = std::stable_partition(v.begin(), v.end(), [&](const Tracked& l) {
        return (!source.empty() && l.source != source) || l.epoch > up_to_epoch;
      });
      links.assign(std::make_move_iterator(doomed), std::make_move_iterator(v.end()));
      v.erase(doomed, v.end());
      tracked_ -= links.size();
      if (v.empty()) links_by_engine_.erase(it);
    }
  }
  // Outside the lock: closing a TCP link waits for its reader thread.
  for (const Tracked& l : links) (void)l.transport->CloseLink(l.link);
}

Frame PeerService::CloseLinks(const Frame& request) {
  absl::StatusOr<handshake::CloseLinksRequest> c =
      handshake::DecodeCloseLinksRequest(request.payload);
  if (!c.ok()) return ErrorFrame(c.status());
  const absl::flat_hash_set<std::string> names(c->links.begin(), c->links.end());
  std::vector<Tracked> close;
  {
    MutexLock lock(&mu_);
    auto it = links_by_engine_.find(c->engine_id);
    if (it != links_by_engine_.end()) {
      auto& v = it->second;
      auto named = std::stable_partition(
          v.begin(), v.end(), [&](const Tracked& l) { return !names.contains(l.params); });
      close.assign(std::make_move_iterator(named), std::make_move_iterator(v.end()));
      v.erase(named, v.end());
      tracked_ -= close.size();
      if (v.empty()) links_by_engine_.erase(it);
    }
  }
  // Once this returns, nothing the requester posted on them can land here.
  for (const Tracked& l : close) (void)l.transport->CloseLink(l.link);
  return Frame{MessageType::kCloseLinksReply, ""};
}

absl::StatusOr<std::string> PeerService::Accept(const handshake::ConnectRequest& c) {
  ASSIGN_OR_RETURN(Tracked link, AcceptLink(c));
  return std::move(link.params);
}

absl::StatusOr<PeerService::Tracked> PeerService::AcceptLink(const handshake::ConnectRequest& c) {
  RETURN_IF_ERROR(RefuseFenced(c.engine_id, c.epoch));
  if (const absl::string_view source = handshake::RequestSource(); !source.empty()) {
    MutexLock lock(&mu_);
    auto it = by_source_.find(source);
    if (it != by_source_.end() && it->second.size() >= kMaxLinksPerSource) {
      auto& v = it->second;
      DropClosed(v);
      if (v.size() >= kMaxLinksPerSource) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the peers at ", source, " hold ", v.size(),
                         " links to this engine already (its share; close some first)"));
      }
    }
  }
  // With several transports, the link parameters say which one made them
  // (transport/link_params.h); with one, it is that one whatever its format.
  absl::StatusOr<std::string> kind = transport::LinkParams::KindOf(c.params);
  if (transports_.size() > 1 && !kind.ok()) return kind.status();
  for (transport::Transport* t : transports_) {
    if (transports_.size() > 1 && t->LocalEndpoint().kind != *kind) continue;
    absl::StatusOr<transport::LinkOffer> offer =
        t->AcceptLink(c.target_nic, c.requester_nic_info, c.params);
    if (!offer.ok()) return offer.status();
    Tracked link{t, offer->link, std::move(offer->params), std::string(handshake::RequestSource()),
                 c.epoch};
    RETURN_IF_ERROR(Track(c.engine_id, link));
    if (const absl::string_view source = handshake::RequestSource(); !source.empty()) {
      MutexLock lock(&mu_);
      by_source_[std::string(source)].push_back(Tracked{link.transport, link.link, "", ""});
    }
    return link;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("this engine has no ", *kind, " transport to accept the link"));
}

Frame PeerService::Connect(const Frame& request) {
  absl::StatusOr<handshake::ConnectRequest> c = handshake::DecodeConnectRequest(request.payload);
  if (!c.ok()) return ErrorFrame(c.status());
  absl::StatusOr<std::string> params = Accept(*c);
  if (!params.ok()) return ErrorFrame(params.status());
  return Frame{MessageType::kConnectReply,
               handshake::Encode(handshake::ConnectReply{std::move(*params)})};
}

handshake::Answer PeerService::ConnectLinks(const Frame& request) {
  absl::StatusOr<handshake::ConnectLinksRequest> c =
      handshake::DecodeConnectLinksRequest(request.payload);
  if (!c.ok()) return ErrorFrame(c.status());
  handshake::ConnectLinksReply reply;
  transport::StreamLinks* first_streams = nullptr;  // the first link's, when it can adopt
  transport::LinkId first = 0;
  for (const handshake::ConnectRequest& link : c->links) {
    // A link whose data connection never arrived waited out the transport's
    // connect timeout (kUnavailable), and the requester gives up the whole
    // set on that code or kDeadlineExceeded: the rest of the batch is not
    // tried (a request full of bogus tokens holds this thread for one
    // timeout, not 64).
    if (!reply.links.empty() && !reply.links.back().ok()) {
      const absl::StatusCode code = reply.links.back().status().code();
      if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
        reply.links.emplace_back(
            absl::Status(code, "not tried: an earlier link of this request could not be reached"));
        continue;
      }
    }
    absl::StatusOr<Tracked> accepted = AcceptLink(link);
    if (accepted.ok() && reply.links.empty()) {
      first_streams = transport::ExtensionOf<transport::StreamLinks>(accepted->transport);
      first = accepted->link;
    }
    reply.links.push_back(accepted.ok() ? absl::StatusOr<std::string>(std::move(accepted->params))
                                        : accepted.status());
  }
  Frame answer{MessageType::kConnectLinksReply, handshake::Encode(reply)};
  // kConnectLinksHere: the first link, accepted, takes the connection once
  // the reply is out.
  if (request.type != MessageType::kConnectLinksHere || first_streams == nullptr) return answer;
  return handshake::Answer(std::move(answer), [first_streams, first](net::Fd connection) {
    // Refused (the link closed meanwhile): the connection closes, and the
    // requester's link with it.
    absl::Status adopted = first_streams->AdoptConnection(first, std::move(connection));
    if (!adopted.ok()) KVF_LOG(WARNING) << "a link could not take its connection: " << adopted;
  });
}

Frame PeerService::Notify(const Frame& request) {
  absl::StatusOr<handshake::Notify> n = handshake::DecodeNotify(request.payload);
  if (!n.ok()) return ErrorFrame(n.status());
  {
    MutexLock lock(&mu_);
    if (absl::Status fenced = RefuseFencedLocked(n->engine_id, n->epoch); !fenced.ok()) {
      return ErrorFrame(fenced);
    }
    SawEpoch(n->engine_id, n->epoch);
  }
  if (n->target_engine_id != 0 && n->target_engine_id != engine_id_) {
    return ErrorFrame(absl::FailedPreconditionError(absl::StrFormat(
        "notification meant for engine %#x, but this is engine %#x (the peer restarted; "
        "what the notification is about went to its predecessor)",
        n->target_engine_id, engine_id_)));
  }
  if (absl::Status pushed = inbox_->Push(Notification{n->engine_id, std::move(n->payload),
                                                      std::string(handshake::RequestSource())});
      !pushed.ok()) {
    return ErrorFrame(pushed);
  }
  return Frame{MessageType::kNotifyAck, ""};
}

handshake::Answer PeerService::Handle(const Frame& request) {
  switch (request.type) {
    case MessageType::kDescribe:
    case MessageType::kDescribeV2: {
      // The payload names the transport asked for (empty: the primary).
      if (request.payload.size() > 16) {
        return ErrorFrame(absl::InvalidArgumentError("describe: transport name too long"));
      }
      absl::StatusOr<handshake::EngineDescriptor> d = Describe(request.payload);
      if (!d.ok()) return ErrorFrame(d.status());
      if (request.type == MessageType::kDescribe) {  // a version 1 peer
        return Frame{MessageType::kDescriptor, handshake::Encode(*d)};
      }
      d->protocol_version = handshake::kProtocolVersion;
      d->capabilities = handshake::kCapabilities;
      return Frame{MessageType::kDescriptorV2, handshake::EncodeDescriptorV2(*d)};
    }
    case MessageType::kConnect:
      return Connect(request);
    case MessageType::kConnectLinks:
    case MessageType::kConnectLinksHere:
      return ConnectLinks(request);
    case MessageType::kNotify:
      return Notify(request);
    case MessageType::kCloseLinks:
      return CloseLinks(request);
    case MessageType::kConfirm: {
      absl::StatusOr<handshake::Confirm> c = handshake::DecodeConfirm(request.payload);
      if (!c.ok()) return ErrorFrame(c.status());
      return Frame{MessageType::kConfirmReply,
                   handshake::Encode(handshake::ConfirmReply{
                       engine_id_, sent_ != nullptr && sent_->Contains(c->digest)})};
    }
    case MessageType::kProbe: {
      absl::StatusOr<handshake::Probe> p = handshake::DecodeProbe(request.payload);
      if (!p.ok()) return ErrorFrame(p.status());
      return Frame{MessageType::kProbeReply,
                   handshake::Encode(handshake::Probe{engine_id_, p->nonce})};
    }
    case MessageType::kGetMetadata: {
      absl::StatusOr<handshake::MetadataRequest> m =
          handshake::DecodeMetadataRequest(request.payload);
      if (!m.ok()) return ErrorFrame(m.status());
      absl::StatusOr<std::string> value = metadata_->Get(m->key);
      if (!value.ok()) return ErrorFrame(value.status());
      return Frame{MessageType::kMetadata,
                   handshake::Encode(handshake::Metadata{m->key, std::move(*value), engine_id_})};
    }
    default:
      // An authentication request reaches the service only without a
      // secret (with one, the network's authentication takes it).
      if (std::optional<Frame> refused = handshake::RefuseWithoutSecret(request)) return *refused;
      return ErrorFrame(absl::InvalidArgumentError(
          absl::StrCat("unexpected ", handshake::MessageTypeName(request.type), " request")));
  }
}

}  // namespace engine_internal
}  // namespace kvferry
