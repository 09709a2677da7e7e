// RDMA device discovery from sysfs, with no CUDA (or libibverbs) dependency:
// which devices and ports are usable, which GID each port should use and
// why, the NUMA node and PCIe position of every NIC and GPU, and which NICs
// are nearest to a buffer. The sysfs root is a parameter, so tests run it
// against fixture trees.
//
// Files read (under `sysfs_root`):
//   class/infiniband/<dev>/device                       -> the PCI device (symlink)
//   class/infiniband/<dev>/device/numa_node
//   class/infiniband_verbs/uverbs<N>/ibdev               (names <dev>)
//   class/infiniband/<dev>/ports/<p>/{state,link_layer}
//   class/infiniband/<dev>/ports/<p>/gids/<i>
//   class/infiniband/<dev>/ports/<p>/gid_attrs/{types,ndevs}/<i>
//   bus/pci/devices/<addr>/{class,vendor,numa_node}     (GPUs)
// and `<dev_root>/infiniband/uverbs<N>` must be readable and writable.
#ifndef KVFERRY_TRANSPORT_VERBS_DISCOVERY_H_
#define KVFERRY_TRANSPORT_VERBS_DISCOVERY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvferry {
namespace transport {
namespace verbs {

struct GidInfo {
  uint32_t index = 0;
  std::string gid;     // as sysfs prints it
  std::string type;    // "RoCE v2", "IB/RoCE v1"
  std::string netdev;  // RoCE: the Ethernet device carrying it
  std::string ipv4;    // for IPv4-mapped GIDs: the address
  int rank = 0;        // lower is better; see RankGid
  // On a netdev other than the port's own (the netdev of its lowest GID
  // index, the default GID): a bridge or overlay address (docker0, ...).
  // Among GIDs of equal rank these lose.
  bool foreign = false;
  std::string why;  // the rank in words
};

struct PortInfo {
  uint32_t port = 0;
  std::string state;          // "ACTIVE", "DOWN", ...
  std::string link_layer;     // "InfiniBand", "Ethernet", or something else
  std::vector<GidInfo> gids;  // non-zero GIDs only, by index
};

struct DeviceInfo {
  std::string name;    // "mlx5_0"
  std::string uverbs;  // "uverbs0", or "" when there is none
  bool uverbs_accessible = false;
  int numa_node = -1;
  std::string pci_path;  // resolved sysfs path of the PCI device
  std::vector<PortInfo> ports;
};

struct GpuInfo {
  std::string name;  // "cuda:0", in PCI bus order
  std::string pci_address;
  int numa_node = -1;
  std::string pci_path;
};

// One port discovery selected, with the GID it will use.
struct SelectedPort {
  std::string device;
  uint32_t port = 0;
  std::string link_layer;
  uint32_t gid_index = 0;
  std::string gid;
  std::string netdev;
  std::string ipv4;
  int numa_node = -1;
  std::string pci_path;
  std::string why;  // why this port and this GID
};

struct DiscoveryOptions {
  std::string sysfs_root = "/sys";
  std::string dev_root = "/dev";
  // Allow-list entries "mlx5_0" or "mlx5_0:1"; entries starting with '^'
  // or '!' exclude a device (or port). Empty: every usable device.
  std::vector<std::string> devices;
  // GID index for every port; -1: ranked choice. FromEnvironment() fills it
  // from MC_GID_INDEX or NCCL_IB_GID_INDEX.
  int gid_index = -1;
  std::string gid_index_source;  // "--gid_index", "MC_GID_INDEX", ...
};

struct Discovery {
  std::vector<DeviceInfo> devices;  // everything found, usable or not
  std::vector<GpuInfo> gpus;
  std::vector<SelectedPort> selected;
  std::vector<std::string> notes;  // each skip or choice, with its reason
};

// Applies MC_GID_INDEX, then NCCL_IB_GID_INDEX, when options.gid_index is
// not set explicitly.
void ApplyEnvironment(DiscoveryOptions* options);

// Reads everything and selects ports. An empty selection is not an error
// (a host without RDMA); naming a device that does not exist
// (kNotFound) or has no ACTIVE port (kFailedPrecondition), a bad list entry
// or a GID index no selected port has (kInvalidArgument) is, and the
// message lists the available devices.
absl::StatusOr<Discovery> Discover(const DiscoveryOptions& options);

// The rank of a GID on a port of `link_layer` (lower is better):
//   0 RoCE v2, IPv4-mapped, routable IPv4   3 RoCE v2, loopback
//   1 RoCE v2, global IPv6                  4 RoCE v2, link-local
//   2 InfiniBand port GID                   5 RoCE v1
int RankGid(const std::string& link_layer, GidInfo* gid);

// PCIe distance between two sysfs device paths: the number of bridges
// between them (hops up to the common ancestor and down again).
int PciDistance(const std::string& a, const std::string& b);

// Selected ports ordered nearest first for a buffer on `location`
// ("cuda:N": the Nth GPU in PCI order; "pci:DDDD:BB:DD.F": the GPU at that
// PCI address; "cpu:N"; or "" for no preference): by PCIe distance to the GPU,
// or same NUMA node first for a CPU buffer. Every port appears; callers use
// the first ones and fall back to the rest. `distances`, if given, receives
// each returned port's distance (equal distances: equally near).
absl::StatusOr<std::vector<SelectedPort>> NearestPorts(const Discovery& d,
                                                       const std::string& location,
                                                       std::vector<int>* distances = nullptr);

// The topology as Mooncake's get_local_topology writes it (JSON): for each
// "cpu:N" and "cuda:N", the nearest devices, then the others.
std::string TopologyJson(const Discovery& d);

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_VERBS_DISCOVERY_H_
