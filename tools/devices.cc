// kvferry devices: what RDMA hardware this host has and what kvferry's
// auto-discovery would use, with the reasons.
//
//   ./bazelw run //tools:devices
//   ./bazelw run //tools:devices -- --json
//   ./bazelw run //tools:devices -- --sysfs_root=/path/to/captured/sys
//   ./bazelw run //tools:devices -- --devices=mlx5_0,mlx5_1 --gid_index=3
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "transport/verbs/discovery.h"

ABSL_FLAG(std::string, sysfs_root, "/sys", "sysfs to read (a captured tree works too)");
ABSL_FLAG(std::string, dev_root, "/dev", "where the uverbs device nodes are");
ABSL_FLAG(std::string, devices, "", "allow-list (mlx5_0,mlx5_1:1) and excludes (^mlx5_2)");
ABSL_FLAG(int, gid_index, -1, "GID index for every port (default: ranked choice)");
ABSL_FLAG(bool, json, false, "print JSON instead of text");

namespace kvferry {
namespace {

using transport::verbs::Discovery;

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
      continue;
    }
    out += c;
  }
  return out + "\"";
}

void PrintJson(const Discovery& d) {
  std::vector<std::string> devices;
  for (const auto& dev : d.devices) {
    std::vector<std::string> ports;
    for (const auto& p : dev.ports) {
      std::vector<std::string> gids;
      for (const auto& g : p.gids) {
        gids.push_back(absl::StrCat("{\"index\":", g.index, ",\"gid\":", Quote(g.gid),
                                    ",\"type\":", Quote(g.type), ",\"netdev\":", Quote(g.netdev),
                                    ",\"rank\":", g.rank, ",\"why\":", Quote(g.why), "}"));
      }
      ports.push_back(absl::StrCat("{\"port\":", p.port, ",\"state\":", Quote(p.state),
                                   ",\"link_layer\":", Quote(p.link_layer), ",\"gids\":[",
                                   absl::StrJoin(gids, ","), "]}"));
    }
    devices.push_back(absl::StrCat("{\"name\":", Quote(dev.name), ",\"uverbs\":",
                                   Quote(dev.uverbs), ",\"numa_node\":", dev.numa_node,
                                   ",\"ports\":[", absl::StrJoin(ports, ","), "]}"));
  }
  std::vector<std::string> selected;
  for (const auto& s : d.selected) {
    selected.push_back(absl::StrCat("{\"device\":", Quote(s.device), ",\"port\":", s.port,
                                    ",\"gid_index\":", s.gid_index, ",\"netdev\":",
                                    Quote(s.netdev), ",\"ipv4\":", Quote(s.ipv4),
                                    ",\"why\":", Quote(s.why), "}"));
  }
  std::vector<std::string> gpus, notes;
  for (const auto& g : d.gpus) {
    gpus.push_back(absl::StrCat("{\"name\":", Quote(g.name), ",\"pci\":", Quote(g.pci_address),
                                ",\"numa_node\":", g.numa_node, "}"));
  }
  for (const auto& n : d.notes) notes.push_back(Quote(n));
  std::printf("{\"devices\":[%s],\"gpus\":[%s],\"selected\":[%s],\"notes\":[%s]}\n",
              absl::StrJoin(devices, ",").c_str(), absl::StrJoin(gpus, ",").c_str(),
              absl::StrJoin(selected, ",").c_str(), absl::StrJoin(notes, ",").c_str());
}

void PrintText(const Discovery& d, const std::string& root) {
  if (d.devices.empty()) {
    std::printf("No RDMA devices under %s/class/infiniband: kvferry will use TCP.\n",
                root.c_str());
    return;
  }
  for (const auto& dev : d.devices) {
    std::printf("%s  %s  NUMA %d  %s\n", dev.name.c_str(),
                dev.uverbs.empty() ? "(no uverbs)" : dev.uverbs.c_str(), dev.numa_node,
                dev.pci_path.c_str());
    for (const auto& p : dev.ports) {
      std::printf("  port %u  %s  %s\n", p.port, p.state.c_str(), p.link_layer.c_str());
      for (const auto& g : p.gids) {
        std::printf("    gid %-2u %s  %-10s %-8s rank %d: %s\n", g.index, g.gid.c_str(),
                    g.type.c_str(), g.netdev.c_str(), g.rank, g.why.c_str());
      }
    }
  }
  for (const auto& g : d.gpus) {
    std::printf("%s  %s  NUMA %d\n", g.name.c_str(), g.pci_address.c_str(), g.numa_node);
  }
  std::printf("\nauto-discovery:\n");
  for (const auto& n : d.notes) std::printf("  %s\n", n.c_str());
  for (const auto& g : d.gpus) {
    auto near = transport::verbs::NearestPorts(d, g.name);
    if (near.ok() && !near->empty()) {
      std::printf("  nearest to %s: %s\n", g.name.c_str(), (*near)[0].device.c_str());
    }
  }
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("lists RDMA devices and what kvferry's auto-discovery selects.");
  absl::ParseCommandLine(argc, argv);
  kvferry::transport::verbs::DiscoveryOptions o;
  o.sysfs_root = absl::GetFlag(FLAGS_sysfs_root);
  o.dev_root = absl::GetFlag(FLAGS_dev_root);
  const std::string list = absl::GetFlag(FLAGS_devices);
  if (!list.empty()) o.devices = absl::StrSplit(list, ',');
  o.gid_index = absl::GetFlag(FLAGS_gid_index);
  if (o.gid_index >= 0) o.gid_index_source = "--gid_index";
  kvferry::transport::verbs::ApplyEnvironment(&o);
  auto d = kvferry::transport::verbs::Discover(o);
  if (!d.ok()) {
    std::fprintf(stderr, "devices: %s\n", d.status().ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    kvferry::PrintJson(*d);
  } else {
    kvferry::PrintText(*d, o.sysfs_root);
  }
  return 0;
}
