#include "handshake/sim_network.h"

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {
namespace {

constexpr uint8_t kRequest = 1;
constexpr uint8_t kReply = 2;
constexpr uint8_t kRefused = 3;
constexpr size_t kHeader = 1 + 2 + 8;
constexpr size_t kMaxAnswered = 4096;

absl::StatusOr<sim::NicId> ParseSimHost(const std::string& host) {
  absl::string_view h = host;
  uint32_t nic;
  if (!absl::ConsumePrefix(&h, "nic") || !absl::ConsumeSuffix(&h, ".sim") ||
      !absl::SimpleAtoi(h, &nic)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", host, "' is not a simulated host (expected nic<N>.sim)"));
  }
  return nic;
}

}  // namespace

class SimNetwork::SimServer final : public Server {
 public:
  SimServer(SimNetwork* network, uint16_t port) : network_(network), port_(port) {}
  ~SimServer() override {
    if (*alive_) network_->servers_.erase(port_);
  }
  std::string address() const override { return absl::StrCat(network_->host(), ":", port_); }

 private:
  friend class SimNetwork;
  SimNetwork* network_;
  uint16_t port_;
  std::shared_ptr<bool> alive_;
};

SimNetwork::SimNetwork(sim::Fabric* fabric, sim::NicId nic, absl::Duration resend_interval)
    : fabric_(fabric), nic_(nic), resend_interval_(resend_interval) {
  fabric_->Attach(nic_, [this](sim::Message&& m) { OnMessage(std::move(m)); });
}

SimNetwork::~SimNetwork() {
  *alive_ = false;
  fabric_->Detach(nic_);
}

std::string SimNetwork::host() const { return absl::StrCat("nic", nic_, ".sim"); }

absl::StatusOr<std::unique_ptr<Server>> SimNetwork::Serve(const ServeOptions& options,
                                                          Handler handler) {
  uint16_t port = options.port;
  if (port == 0) {
    for (uint32_t p = options.first_port; p <= options.last_port && p != 0; ++p) {
      if (servers_.count(static_cast<uint16_t>(p)) == 0) {
        port = static_cast<uint16_t>(p);
        break;
      }
    }
    if (port == 0) return absl::ResourceExhaustedError("no free simulated port");
  } else if (servers_.count(port) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(host(), ":", port, " is in use"));
  }
  servers_[port] = std::move(handler);
  auto server = std::make_unique<SimServer>(this, port);
  server->alive_ = alive_;
  return std::unique_ptr<Server>(std::move(server));
}

void SimNetwork::Send(sim::NicId to, uint8_t kind, uint16_t port, uint64_t id,
                      const std::string& body) {
  std::string bytes(kHeader, '\0');
  bytes[0] = static_cast<char>(kind);
  std::memcpy(&bytes[1], &port, 2);
  std::memcpy(&bytes[3], &id, 8);
  bytes += body;
  fabric_->Send(nic_, to, bytes.size(), std::move(bytes));
}

void SimNetwork::OnMessage(sim::Message&& msg) {
  if (msg.bytes.size() < kHeader) return;
  const uint8_t kind = static_cast<uint8_t>(msg.bytes[0]);
  uint16_t port;
  uint64_t id;
  std::memcpy(&port, &msg.bytes[1], 2);
  std::memcpy(&id, &msg.bytes[3], 8);
  absl::string_view body(msg.bytes);
  body.remove_prefix(kHeader);
  if (kind == kReply || kind == kRefused) {
    auto it = replies_.find(id);
    if (it == replies_.end() || it->second.answered) return;  // late or duplicate
    Reply& r = it->second;
    if (kind == kRefused) {
      r.answered = r.refused = true;
      return;
    }
    auto header = ParseFrameHeader(body, kDefaultMaxFrameBytes);
    if (!header.ok() || body.size() != kFrameHeaderBytes + header->payload_bytes) return;
    r.frame.type = header->type;
    r.frame.payload = std::string(body.substr(kFrameHeaderBytes));
    r.answered = true;
    return;
  }
  if (kind != kRequest) return;
  const auto key = std::make_pair(msg.from, id);
  auto done = answered_.find(key);
  if (done != answered_.end()) {  // a resend: answer again, do not run twice
    Send(msg.from, kReply, port, id, done->second);
    return;
  }
  auto server = servers_.find(port);
  if (server == servers_.end()) {
    Send(msg.from, kRefused, port, id, "");
    return;
  }
  Frame reply;
  auto header = ParseFrameHeader(body, kDefaultMaxFrameBytes);
  if (!header.ok()) {
    reply = ErrorFrame(header.status());
  } else if (body.size() != kFrameHeaderBytes + header->payload_bytes) {
    reply = ErrorFrame(absl::DataLossError("truncated frame"));
  } else {
    reply = server->second(Frame{header->type, std::string(body.substr(kFrameHeaderBytes))});
  }
  std::string encoded = EncodeFrame(reply.type, reply.payload);
  if (answered_.size() >= kMaxAnswered) answered_.erase(answered_.begin());
  answered_[key] = encoded;
  Send(msg.from, kReply, port, id, encoded);
}

absl::StatusOr<Frame> SimNetwork::Call(const std::string& peer, const Frame& request,
                                       absl::Duration timeout) {
  ASSIGN_OR_RETURN(net::HostPort hp, net::ParseHostPort(peer));
  ASSIGN_OR_RETURN(sim::NicId to, ParseSimHost(hp.host));
  if (!fabric_->topology().HasNic(to)) {
    return absl::UnavailableError(absl::StrCat("handshake with ", peer, ": no such host"));
  }
  sim::Scheduler* sched = fabric_->scheduler();
  // Call ids must never repeat on a NIC, also across networks: a restarted
  // engine's new network on the same NIC would otherwise get the answers the
  // peer cached for its predecessor's calls (and its requests would never
  // run). Hence the instance number, unique in the process.
  const uint64_t id = (instance_ << 32) | ++next_call_;
  replies_[id] = Reply{};
  const std::string encoded = EncodeFrame(request.type, request.payload);
  const sim::SimTime deadline = sched->now() + sim::ToSimTime(timeout);
  std::shared_ptr<bool> alive = alive_;
  auto answered = [&] { return !*alive || replies_.at(id).answered; };
  while (!answered() && sched->now() < deadline) {
    Send(to, kRequest, hp.port, id, encoded);
    sched->RunUntilCondition(answered,
                             std::min(deadline, sched->now() + sim::ToSimTime(resend_interval_)));
  }
  if (!*alive) return absl::CancelledError("the network was destroyed during a call");
  Reply r = std::move(replies_.at(id));
  replies_.erase(id);
  if (r.refused) {
    return absl::UnavailableError(
        absl::StrCat("handshake with ", peer, " failed: connection refused"));
  }
  if (!r.answered) {
    return absl::UnavailableError(absl::StrCat("handshake with ", peer, ": no answer within ",
                                               absl::FormatDuration(timeout), " (simulated)"));
  }
  if (r.frame.type == MessageType::kError) return DecodeError(r.frame.payload);
  return r.frame;
}

}  // namespace handshake
}  // namespace kvferry
