// The simulated fabric's shape and its failures: nodes (hosts), their NICs,
// which of them are up, and which node pairs are cut off from each other.
// The fabric (sim/fabric.h) moves messages over it; a path is open while
// both NICs and their nodes are up and no partition cuts their nodes apart.
//
// Not thread-safe: driven by the scheduler's thread.
#ifndef KVFERRY_SIM_TOPOLOGY_H_
#define KVFERRY_SIM_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sim/scheduler.h"

namespace kvferry {
namespace sim {

using NodeId = uint32_t;
using NicId = uint32_t;

struct NicSpec {
  uint64_t bits_per_sec = 100'000'000'000;         // 100 Gb/s
  absl::Duration latency = absl::Microseconds(1);  // NIC to switch, one way
  uint32_t mtu = 4096;
};

class Topology {
 public:
  // `scheduler` (which traces the ups and downs) must outlive this.
  explicit Topology(Scheduler* scheduler) : scheduler_(scheduler) {}

  NodeId AddNode(std::string name);
  // Adds a NIC to `node`. kInvalidArgument for an unknown node, a zero rate
  // or an MTU below 256.
  absl::StatusOr<NicId> AddNic(NodeId node, NicSpec spec);

  bool HasNic(NicId nic) const { return nic < nics_.size(); }
  const NicSpec& nic_spec(NicId nic) const { return nics_[nic].spec; }
  NodeId node_of(NicId nic) const { return nics_[nic].node; }
  const std::string& node_name(NodeId node) const { return nodes_[node].name; }
  size_t node_count() const { return nodes_.size(); }
  size_t nic_count() const { return nics_.size(); }

  // A node or NIC that is down neither sends nor receives; messages in
  // flight to it when it goes down are lost.
  void SetNicUp(NicId nic, bool up);
  void SetNodeUp(NodeId node, bool up);
  bool IsNicUp(NicId nic) const;
  bool IsNodeUp(NodeId node) const { return nodes_[node].up; }
  // Cuts every path between a node of `a` and a node of `b` until Heal().
  void Partition(const std::vector<NodeId>& a, const std::vector<NodeId>& b);
  // Restores the paths between nodes `a` and `b` only.
  void HealPair(NodeId a, NodeId b);
  // Restores every path.
  void Heal() { cut_pairs_.clear(); }
  bool IsPartitioned() const { return !cut_pairs_.empty(); }
  // Whether a message from `from` to `to` can pass now.
  bool PathOpen(NicId from, NicId to) const;

 private:
  struct Node {
    std::string name;
    bool up = true;
  };
  struct Nic {
    NodeId node;
    NicSpec spec;
    bool up = true;
  };

  Scheduler* const scheduler_;
  std::vector<Node> nodes_;
  std::vector<Nic> nics_;
  absl::flat_hash_set<uint64_t> cut_pairs_;  // (min node << 32) | max node
};

// (min << 32) | max of two nodes (or NICs): one key for the pair.
uint64_t PairKey(uint32_t a, uint32_t b);

}  // namespace sim
}  // namespace kvferry

#endif  // KVFERRY_SIM_TOPOLOGY_H_
