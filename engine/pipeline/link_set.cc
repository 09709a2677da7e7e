#include "engine/pipeline/link_set.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "transport/stream_links.h"

namespace kvferry {
namespace engine_internal {

using transport::NicIndex;

namespace {

uint64_t Weight(const transport::NicInfo& a, const transport::NicInfo& b) {
  uint64_t mbps = 0;
  for (uint64_t bits : {a.link_bits_per_sec, b.link_bits_per_sec}) {
    if (bits != 0) mbps = mbps == 0 ? bits / 1000000 : std::min(mbps, bits / 1000000);
  }
  return std::max<uint64_t>(1, mbps);
}

}  // namespace

absl::StatusOr<Link> ConnectLink(transport::Transport* transport, const PeerClient& client,
                                 uint64_t engine_id, const std::string& peer,
                                 const transport::NicInfo& local_nic_info,
                                 const transport::NicInfo& peer_nic_info, Link link) {
  ASSIGN_OR_RETURN(transport::LinkOffer offer,
                   transport->CreateLink(link.local_nic, peer_nic_info));
  absl::StatusOr<std::string> params =
      client.Connect(peer, handshake::ConnectRequest{engine_id, link.local_nic, local_nic_info,
                                                     link.remote_nic, offer.params, link.epoch});
  absl::Status done = params.ok() ? transport->CompleteLink(offer.link, *params) : params.status();
  if (!done.ok()) {
    (void)transport->CloseLink(offer.link);
    return done;
  }
  link.id = offer.link;
  link.peer_params = std::move(*params);
  link.peer_closed = false;
  link.weight = Weight(local_nic_info, peer_nic_info);
  link.failed = false;
  link.repairing = false;
  link.load = std::make_shared<LinkLoad>();  // a new link: nothing in flight
  return link;
}

namespace {

bool Unreachable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

// Link k of a new set: its NIC pair (the local NIC the host's routes say
// reaches the peer NIC, verbs with rdma_cm; else the NICs in order).
Link PlanLink(transport::Transport* transport, const transport::EndpointDescription& local,
              const handshake::EngineDescriptor& d, uint32_t k, absl::Time now) {
  Link link;
  link.remote_nic = k % d.nics.size();
  absl::StatusOr<NicIndex> routed = transport->RouteTo(d.nics[link.remote_nic]);
  link.local_nic = routed.ok() && *routed < local.nics.size()
                       ? *routed
                       : static_cast<NicIndex>(k % local.nics.size());
  link.set_progress(now);
  link.weight = Weight(local.nics[link.local_nic], d.nics[link.remote_nic]);
  return link;
}

// The links whose `outcome` is OK. A peer that cannot be reached fails the
// whole set (closing what came up); one NIC pair failing (a NIC down on
// either side) costs only that pair.
absl::StatusOr<std::vector<Link>> KeepWorking(transport::Transport* transport,
                                              const std::string& peer,
                                              const std::vector<Link>& links,
                                              const std::vector<absl::Status>& outcome) {
  const absl::Status* unreachable = nullptr;
  const absl::Status* last_error = nullptr;
  std::vector<Link> up;
  for (size_t k = 0; k < links.size(); ++k) {
    if (outcome[k].ok()) {
      up.push_back(links[k]);
      continue;
    }
    last_error = &outcome[k];
    if (unreachable == nullptr && Unreachable(outcome[k])) unreachable = &outcome[k];
  }
  if (unreachable != nullptr || up.empty()) {
    for (const Link& l : up) (void)transport->CloseLink(l.id);
    return Annotate(unreachable != nullptr ? *unreachable : *last_error,
                    absl::StrCat("connecting to ", peer));
  }
  for (size_t k = 0; k < links.size(); ++k) {
    if (outcome[k].ok()) continue;
    KVF_LOG(WARNING) << "connecting to " << peer << ": no link from local NIC "
                     << links[k].local_nic << " to peer NIC " << links[k].remote_nic << ": "
                     << outcome[k].message();
  }
  return up;
}

}  // namespace

absl::StatusOr<std::vector<Link>> ConnectLinks(transport::Transport* transport,
                                               const PeerClient& client, uint64_t engine_id,
                                               const std::string& peer,
                                               const handshake::EngineDescriptor& d,
                                               uint32_t links_per_peer, absl::Time now) {
  const transport::EndpointDescription local = transport->LocalEndpoint();
  if (d.nics.empty() || local.nics.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("no NICs to reach ", peer, " with"));
  }
  // At least one link per local NIC, so every NIC can carry slices.
  const uint32_t count =
      std::max<uint32_t>({1, links_per_peer, static_cast<uint32_t>(local.nics.size())});
  // Every link's local half first, then one round trip asks the peer for all
  // of them (they come up together instead of one after another).
  std::vector<Link> links;
  std::vector<absl::Status> outcome(count);
  std::vector<handshake::ConnectRequest> requests;
  std::vector<uint32_t> asked;  // index in `links` of each request
  const uint64_t epoch = client.EpochWith(peer);
  for (uint32_t k = 0; k < count; ++k) {
    Link& link = links.emplace_back(PlanLink(transport, local, d, k, now));
    link.epoch = epoch;
    absl::StatusOr<transport::LinkOffer> offer =
        transport->CreateLink(link.local_nic, d.nics[link.remote_nic]);
    if (!offer.ok()) {
      outcome[k] = offer.status();
      continue;
    }
    link.id = offer->link;
    requests.push_back(handshake::ConnectRequest{engine_id, link.local_nic,
                                                 local.nics[link.local_nic], link.remote_nic,
                                                 std::move(offer->params), epoch});
    asked.push_back(k);
  }
  if (!requests.empty()) {
    absl::StatusOr<std::vector<absl::StatusOr<std::string>>> answers =
        client.ConnectLinks(peer, std::move(requests), d.capabilities);
    for (size_t i = 0; i < asked.size(); ++i) {
      const uint32_t k = asked[i];
      outcome[k] = answers.ok() ? (*answers)[i].status() : answers.status();
      if (outcome[k].ok()) outcome[k] = transport->CompleteLink(links[k].id, *(*answers)[i]);
      if (outcome[k].ok()) links[k].peer_params = *(*answers)[i];
      if (!outcome[k].ok()) (void)transport->CloseLink(links[k].id);
    }
  }
  return KeepWorking(transport, peer, links, outcome);
}

namespace {

// Offers `count` links of `transport`'s only NIC (closed again on failure).
absl::StatusOr<std::vector<transport::LinkOffer>> OfferLinks(transport::Transport* transport,
                                                             transport::StreamLinks* streams,
                                                             uint32_t count) {
  std::vector<transport::LinkOffer> offers;
  for (uint32_t k = 0; k < count; ++k) {
    absl::StatusOr<transport::LinkOffer> offer = streams->OfferLink(0);
    if (!offer.ok()) {
      for (const transport::LinkOffer& o : offers) (void)transport->CloseLink(o.link);
      return offer.status();
    }
    offers.push_back(std::move(*offer));
  }
  return offers;
}

}  // namespace

absl::StatusOr<DescribedLinks> DescribeWithLinks(transport::Transport* transport,
                                                 const PeerClient& client, uint64_t engine_id,
                                                 const std::string& peer, const std::string& kind,
                                                 uint32_t links_per_peer, absl::Time now) {
  transport::StreamLinks* streams = transport::ExtensionOf<transport::StreamLinks>(transport);
  if (streams == nullptr) return absl::UnimplementedError("links need the peer's NICs first");
  const transport::EndpointDescription local = transport->LocalEndpoint();
  absl::StatusOr<std::vector<transport::LinkOffer>> offers =
      local.nics.size() == 1 ? OfferLinks(transport, streams, std::max<uint32_t>(1, links_per_peer))
                             : absl::UnimplementedError("several local NICs");
  RETURN_IF_ERROR(offers.status());  // kUnimplemented: the usual way
  std::vector<handshake::ConnectRequest> requests;
  const uint64_t epoch = client.EpochWith(peer);
  for (const transport::LinkOffer& o : *offers) {
    requests.push_back(handshake::ConnectRequest{engine_id, 0, local.nics[0], 0, o.params, epoch});
  }
  std::vector<Link> links;
  std::vector<absl::Status> outcome;
  // The first link rides the handshake's connection where it can: one
  // connection to set up instead of two.
  const bool ride = client.CanRide();
  absl::StatusOr<PeerClient::Described> described = client.DescribeAndConnect(
      peer, kind, std::move(requests),
      [&](const handshake::EngineDescriptor& d) {
        if (d.transport_kind != kind || d.nics.size() != 1) return false;
        for (uint32_t k = 0; k < offers->size(); ++k) {
          Link& link = links.emplace_back(PlanLink(transport, local, d, k, now));
          link.id = (*offers)[k].link;
          link.epoch = epoch;
          outcome.push_back(k == 0 && ride ? absl::OkStatus()
                                           : streams->ConnectOffered(link.id, d.nics[0]));
        }
        return true;
      },
      ride ? PeerClient::Ride([&](net::Fd connection) {
        return streams->AdoptConnection((*offers)[0].link, std::move(connection));
      })
           : nullptr);
  absl::StatusOr<PeerClient::LinkAnswers> answers =
      described.ok() ? std::move(described->links) : described.status();
  for (size_t k = 0; k < links.size(); ++k) {
    if (outcome[k].ok()) outcome[k] = answers.ok() ? (*answers)[k].status() : answers.status();
    if (outcome[k].ok()) outcome[k] = transport->CompleteLink(links[k].id, *(*answers)[k]);
    if (outcome[k].ok()) links[k].peer_params = *(*answers)[k];
  }
  for (size_t k = 0; k < offers->size(); ++k) {
    if (k >= links.size() || !outcome[k].ok()) (void)transport->CloseLink((*offers)[k].link);
  }
  RETURN_IF_ERROR(described.status());
  DescribedLinks out{std::move(described->descriptor)};
  if (!links.empty()) out.links = KeepWorking(transport, peer, links, outcome);
  return out;
}

namespace {

// The index of the link ChooseLink would take, with link i's load load(i);
// -1 when none has room.
template <typename LoadOf>
int Choose(const std::vector<Link>& links, LoadOf load_of, NicMask near, uint32_t capacity,
           size_t start) {
  int best = -1, best_far = -1;
  uint32_t best_load = 0, best_far_load = 0;
  const size_t n = links.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (start + k) % n;
    const Link& l = links[i];
    if (l.failed) continue;
    const uint32_t load = load_of(i);
    if (load >= capacity) continue;
    const bool is_near = near == 0 || (l.local_nic < 64 && (near >> l.local_nic) & 1);
    int& slot = is_near ? best : best_far;
    uint32_t& slot_load = is_near ? best_load : best_far_load;
    // Fewer in flight per unit of speed: a / wa < b / wb.
    if (slot < 0 || uint64_t{load} * links[slot].weight < uint64_t{slot_load} * l.weight) {
      slot = static_cast<int>(i);
      slot_load = load;
    }
    if (is_near && load == 0) break;  // none is less loaded
  }
  return best >= 0 ? best : best_far;
}

}  // namespace

const Link* ChooseLink(const std::vector<Link>& links, NicMask near, uint32_t capacity,
                       size_t start, absl::Time now) {
  // The lane's own link, when it is near and idle: what Choose would pick
  // first (it stops at the first near link with nothing in flight).
  if (!links.empty()) {
    const Link& home = links[start % links.size()];
    if (!home.failed && (near == 0 || (home.local_nic < 64 && (near >> home.local_nic) & 1)) &&
        home.inflight() == 0 && home.load->TryTake(capacity, now)) {
      return &home;
    }
  }
  // Another thread may take the last place between the look and the take:
  // look again then.
  for (;;) {
    const int i = Choose(
        links, [&](size_t k) { return links[k].inflight(); }, near, capacity, start);
    if (i < 0) return nullptr;
    if (links[i].load->TryTake(capacity, now)) return &links[i];
  }
}

bool LinkPlan::Begin(const std::vector<Link>* links, uint32_t capacity, size_t start) {
  if (links->size() > kMaxLinks) return false;
  links_ = links;
  capacity_ = capacity;
  start_ = start;
  // Loads are read when Choose first looks at them: a thread whose own
  // link is idle reads no other thread's.
  for (size_t i = 0; i < links->size(); ++i) {
    load_[i] = kUnread;
    added_[i] = 0;
  }
  return true;
}

int LinkPlan::Next(NicMask near) {
  auto load_of = [&](size_t k) {
    if (load_[k] == kUnread) load_[k] = (*links_)[k].inflight();
    return load_[k];
  };
  const int i = Choose(*links_, load_of, near, capacity_, start_);
  if (i >= 0) {
    ++load_[i];
    ++added_[i];
  }
  return i;
}

bool LinkPlan::Take(absl::Time now) {
  return TakePlaces(*links_, added_, links_->size(), capacity_, now);
}

bool TakePlaces(const std::vector<Link>& links, const uint32_t* counts, size_t n, uint32_t capacity,
                absl::Time now) {
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] == 0) continue;
    LinkLoad& load = *links[i].load;
    const uint32_t had = load.inflight.fetch_add(counts[i], std::memory_order_relaxed);
    if (had + counts[i] > capacity) {
      for (size_t j = 0; j <= i; ++j) {
        if (counts[j] > 0) links[j].load->inflight.fetch_sub(counts[j], std::memory_order_relaxed);
      }
      return false;
    }
    if (had == 0) load.progress_ns.store(absl::ToUnixNanos(now), std::memory_order_relaxed);
  }
  return true;
}

}  // namespace engine_internal
}  // namespace kvferry
