#include "sim/topology.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvferry {
namespace sim {

uint64_t PairKey(uint32_t a, uint32_t b) {
  if (a > b) std::swap(a, b);
  return (static_cast<uint64_t>(a) << 32) | b;
}

NodeId Topology::AddNode(std::string name) {
  nodes_.push_back(Node{std::move(name), true});
  return static_cast<NodeId>(nodes_.size() - 1);
}

absl::StatusOr<NicId> Topology::AddNic(NodeId node, NicSpec spec) {
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

bool Topology::IsNicUp(NicId nic) const { return nics_[nic].up && nodes_[nics_[nic].node].up; }

bool Topology::PathOpen(NicId from, NicId to) const {
  if (!IsNicUp(from) || !IsNicUp(to)) return false;
  return !cut_pairs_.contains(PairKey(nics_[from].node, nics_[to].node));
}

void Topology::SetNicUp(NicId nic, bool up) {
  nics_[nic].up = up;
  scheduler_->Trace((uint64_t{nic} << 1) | up);
}

void Topology::SetNodeUp(NodeId node, bool up) {
  nodes_[node].up = up;
  scheduler_->Trace((uint64_t{node} << 1) | up | (uint64_t{1} << 40));
}

void Topology::Partition(const std::vector<NodeId>& a, const std::vector<NodeId>& b) {
  for (NodeId x : a) {
    for (NodeId y : b) {
      if (x != y) cut_pairs_.insert(PairKey(x, y));
    }
  }
}

void Topology::HealPair(NodeId a, NodeId b) { cut_pairs_.erase(PairKey(a, b)); }

}  // namespace sim
}  // namespace kvferry
