#include "sim/fabric.h"

#include <algorithm>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvferry {
namespace sim {
namespace {

uint64_t PairKey(NodeId a, NodeId b) {
  if (a > b) std::swap(a, b);
  return (static_cast<uint64_t>(a) << 32) | b;
}

}  // namespace

Fabric::Fabric(Scheduler* scheduler, uint64_t seed, FaultOptions faults)
    : scheduler_(scheduler), prng_(seed), faults_(faults) {}

NodeId Fabric::AddNode(std::string name) {
  nodes_.push_back(Node{std::move(name), true});
  return static_cast<NodeId>(nodes_.size() - 1);
}

absl::StatusOr<NicId> Fabric::AddNic(NodeId node, NicSpec spec) {
  if (node >= nodes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown node ", node));
  }
  if (spec.bits_per_sec == 0) {
    return absl::InvalidArgumentError("NIC rate must be positive");
  }
  if (spec.mtu < 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("NIC MTU ", spec.mtu, " is below the minimum of 256"));
  }
  if (spec.latency < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NIC latency must not be negative");
  }
  nics_.push_back(Nic{node, spec});
  return static_cast<NicId>(nics_.size() - 1);
}

void Fabric::Attach(NicId nic, Receiver receiver) {
  nics_[nic].receiver = std::move(receiver);
}

void Fabric::Detach(NicId nic) {
  if (nic < nics_.size()) nics_[nic].receiver = nullptr;
}

SimTime Fabric::SerializationTime(uint64_t bytes, uint64_t bits_per_sec) {
  unsigned __int128 bits = static_cast<unsigned __int128>(bytes) * 8;
  unsigned __int128 ns = (bits * 1'000'000'000 + bits_per_sec - 1) / bits_per_sec;
  return static_cast<SimTime>(ns);
}

bool Fabric::IsNicUp(NicId nic) const {
  return nics_[nic].up && nodes_[nics_[nic].node].up;
}

bool Fabric::PathOpen(NicId from, NicId to) const {
  if (!IsNicUp(from) || !IsNicUp(to)) return false;
  return !cut_pairs_.contains(PairKey(nics_[from].node, nics_[to].node));
}

bool Fabric::DropsPacketOf(uint64_t wire_bytes, uint32_t mtu) {
  if (faults_.drop.num == 0) return false;
  const uint64_t packets = std::max<uint64_t>(1, (wire_bytes + mtu - 1) / mtu);
  // Draw for every packet so the number of draws depends only on the size.
  bool dropped = false;
  for (uint64_t i = 0; i < packets; ++i) dropped |= prng_.Chance(faults_.drop);
  return dropped;
}

SimTime Fabric::Send(NicId from, NicId to, uint64_t wire_bytes,
                     std::string bytes) {
  Nic& src = nics_[from];
  Nic& dst = nics_[to];
  const SimTime now = scheduler_->now();
  const SimTime tx_start = std::max(now, src.tx_free);
  const SimTime tx_end =
      tx_start + SerializationTime(wire_bytes, src.spec.bits_per_sec);
  ++stats_.sent;
  scheduler_->Trace(PairKey(from, to) ^ wire_bytes);
  if (!PathOpen(from, to)) {
    ++stats_.dropped;
    return tx_end;  // nothing leaves a dead path; the time is nominal
  }
  src.tx_free = tx_end;
  SimTime path = ToSimTime(src.spec.latency + dst.spec.latency);
  if (prng_.Chance(faults_.delay)) {
    path += prng_.UniformIn(0, ToSimTime(faults_.max_delay));
  }
  const uint32_t mtu = std::min(src.spec.mtu, dst.spec.mtu);
  if (DropsPacketOf(wire_bytes, mtu)) {
    ++stats_.dropped;
    scheduler_->Trace(uint64_t{0xd0});
    return tx_end;
  }
  const SimTime held = std::max<SimTime>(0, src.held_until - tx_start);  // HoldNic
  const SimTime rx_start = std::max(tx_start + held + path, dst.rx_free);
  const SimTime arrival =
      std::max(rx_start + SerializationTime(wire_bytes, dst.spec.bits_per_sec),
               tx_end + held + path);
  dst.rx_free = arrival;
  Message msg{from, to, std::move(bytes)};
  scheduler_->At(arrival, [this, m = std::move(msg)]() mutable {
    Deliver(std::move(m));
  });
  return tx_end;
}

void Fabric::HoldNic(NicId nic, absl::Duration d) {
  nics_[nic].held_until = std::max(nics_[nic].held_until, scheduler_->now() + ToSimTime(d));
}

void Fabric::Deliver(Message&& msg) {
  Nic& dst = nics_[msg.to];
  // Checked again at arrival: whatever went down meanwhile loses the message.
  if (!PathOpen(msg.from, msg.to) || !dst.receiver) {
    ++stats_.dropped;
    scheduler_->Trace(uint64_t{0xd1});
    return;
  }
  ++stats_.delivered;
  stats_.bytes_delivered += msg.bytes.size();
  // Copy the receiver: it may detach itself (or others) while running.
  Receiver receiver = dst.receiver;
  receiver(std::move(msg));
}

void Fabric::SetNicUp(NicId nic, bool up) {
  nics_[nic].up = up;
  scheduler_->Trace((uint64_t{nic} << 1) | up);
}

void Fabric::SetNodeUp(NodeId node, bool up) {
  nodes_[node].up = up;
  scheduler_->Trace((uint64_t{node} << 1) | up | (uint64_t{1} << 40));
}

void Fabric::Partition(const std::vector<NodeId>& a,
                       const std::vector<NodeId>& b) {
  for (NodeId x : a) {
    for (NodeId y : b) {
      if (x != y) cut_pairs_.insert(PairKey(x, y));
    }
  }
}

void Fabric::HealPair(NodeId a, NodeId b) { cut_pairs_.erase(PairKey(a, b)); }

void Fabric::Heal() { cut_pairs_.clear(); }

}  // namespace sim
}  // namespace kvferry
