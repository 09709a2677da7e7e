#include "transport/verbs/discovery.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "topology/location.h"

namespace kvferry {
namespace transport {
namespace verbs {
namespace {

namespace fs = std::filesystem;

std::string ReadTrimmed(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(s.str()));
}

int ReadInt(const fs::path& p, int fallback) {
  int v;
  return absl::SimpleAtoi(ReadTrimmed(p), &v) ? v : fallback;
}

// Sorted names of the entries of a directory ("" list when absent).
std::vector<std::string> List(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

std::string Resolve(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::canonical(p, ec);
  return ec ? "" : r.string();
}

// Parses a sysfs GID ("fe80:0000:...:0001") into 16 bytes.
bool ParseGid(const std::string& text, unsigned char out[16]) {
  std::vector<std::string> groups = absl::StrSplit(text, ':');
  if (groups.size() != 8) return false;
  for (int i = 0; i < 8; ++i) {
    uint32_t v;
    if (groups[i].size() != 4 || !absl::SimpleHexAtoi(groups[i], &v)) return false;
    out[2 * i] = static_cast<unsigned char>(v >> 8);
    out[2 * i + 1] = static_cast<unsigned char>(v);
  }
  return true;
}

PortInfo ReadPort(const fs::path& dir, uint32_t port) {
  PortInfo p;
  p.port = port;
  // "4: ACTIVE"
  std::string state = ReadTrimmed(dir / "state");
  const size_t colon = state.find(':');
  p.state = std::string(
      absl::StripAsciiWhitespace(colon == std::string::npos ? state : state.substr(colon + 1)));
  p.link_layer = ReadTrimmed(dir / "link_layer");
  for (const std::string& name : List(dir / "gids")) {
    uint32_t index;
    if (!absl::SimpleAtoi(name, &index)) continue;
    GidInfo g;
    g.index = index;
    g.gid = ReadTrimmed(dir / "gids" / name);
    unsigned char raw[16];
    if (!ParseGid(g.gid, raw) ||
        std::all_of(raw, raw + 16, [](unsigned char c) { return c == 0; })) {
      continue;  // an empty slot
    }
    g.type = ReadTrimmed(dir / "gid_attrs" / "types" / name);
    g.netdev = ReadTrimmed(dir / "gid_attrs" / "ndevs" / name);
    RankGid(p.link_layer, &g);
    p.gids.push_back(std::move(g));
  }
  std::sort(p.gids.begin(), p.gids.end(),
            [](const GidInfo& a, const GidInfo& b) { return a.index < b.index; });
  const std::string own = p.gids.empty() ? "" : p.gids[0].netdev;
  for (GidInfo& g : p.gids) {
    g.foreign = !own.empty() && !g.netdev.empty() && g.netdev != own;
    if (g.foreign) absl::StrAppend(&g.why, " on ", g.netdev, ", not the port's own ", own);
  }
  return p;
}

DeviceInfo ReadDevice(const fs::path& root, const std::string& name, const std::string& dev_root) {
  const fs::path dir = root / "class" / "infiniband" / name;
  DeviceInfo d;
  d.name = name;
  d.pci_path = Resolve(dir / "device");  // software devices (rxe) have none
  d.numa_node = ReadInt(dir / "device" / "numa_node", -1);
  // class/infiniband_verbs/uverbsN/ibdev names the device, as rdma-core
  // reads it; hardware devices also list it under their PCI device.
  for (const std::string& u : List(root / "class" / "infiniband_verbs")) {
    if (absl::StartsWith(u, "uverbs") &&
        ReadTrimmed(root / "class" / "infiniband_verbs" / u / "ibdev") == name) {
      d.uverbs = u;
    }
  }
  for (const std::string& u : List(dir / "device" / "infiniband_verbs")) {
    if (d.uverbs.empty() && absl::StartsWith(u, "uverbs")) d.uverbs = u;
  }
  if (!d.uverbs.empty()) {
    const std::string node = absl::StrCat(dev_root, "/infiniband/", d.uverbs);
    d.uverbs_accessible = ::access(node.c_str(), R_OK | W_OK) == 0;
  }
  for (const std::string& p : List(dir / "ports")) {
    uint32_t port;
    if (absl::SimpleAtoi(p, &port)) d.ports.push_back(ReadPort(dir / "ports" / p, port));
  }
  return d;
}

std::vector<GpuInfo> ReadGpus(const fs::path& root) {
  std::vector<GpuInfo> gpus;
  for (const std::string& addr : List(root / "bus" / "pci" / "devices")) {
    const fs::path dir = root / "bus" / "pci" / "devices" / addr;
    const std::string cls = ReadTrimmed(dir / "class");
    // NVIDIA display (0x0300xx) and 3D (0x0302xx) controllers.
    if (ReadTrimmed(dir / "vendor") != "0x10de" ||
        !(absl::StartsWith(cls, "0x0300") || absl::StartsWith(cls, "0x0302"))) {
      continue;
    }
    GpuInfo g;
    g.pci_address = addr;
    g.numa_node = ReadInt(dir / "numa_node", -1);
    g.pci_path = Resolve(dir);
    gpus.push_back(std::move(g));
  }
  // CUDA numbers GPUs in PCI bus order with CUDA_DEVICE_ORDER=PCI_BUS_ID.
  for (size_t i = 0; i < gpus.size(); ++i) gpus[i].name = absl::StrCat("cuda:", i);
  return gpus;
}

struct Filter {
  struct Entry {
    std::string device;
    uint32_t port = 0;  // 0: every port
  };
  std::vector<Entry> allow, exclude;
};

absl::StatusOr<Filter> ParseFilter(const std::vector<std::string>& list) {
  Filter f;
  for (std::string entry : list) {
    bool exclude = false;
    if (!entry.empty() && (entry[0] == '^' || entry[0] == '!')) {
      exclude = true;
      entry.erase(0, 1);
    }
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    Filter::Entry e;
    e.device = parts[0];
    if (e.device.empty() || parts.size() > 2 ||
        (parts.size() == 2 && (!absl::SimpleAtoi(parts[1], &e.port) || e.port == 0))) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad device entry '", entry, "' (expected mlx5_0, mlx5_0:1, ^mlx5_1)"));
    }
    (exclude ? f.exclude : f.allow).push_back(e);
  }
  return f;
}

bool Matches(const std::vector<Filter::Entry>& list, const std::string& dev, uint32_t port) {
  for (const auto& e : list) {
    if (e.device == dev && (e.port == 0 || e.port == port)) return true;
  }
  return false;
}

std::string Available(const std::vector<DeviceInfo>& devices) {
  std::vector<std::string> out;
  for (const DeviceInfo& d : devices) {
    std::vector<std::string> ports;
    for (const PortInfo& p : d.ports) ports.push_back(absl::StrCat(p.port, ":", p.state));
    out.push_back(absl::StrCat(d.name, " (port ", absl::StrJoin(ports, ", "), ")"));
  }
  return out.empty() ? "none" : absl::StrJoin(out, "; ");
}

// Why a port cannot be used, or "" if it can.
std::string Unusable(const DeviceInfo& d, const PortInfo& p) {
  if (d.uverbs.empty()) return "no uverbs device";
  if (!d.uverbs_accessible) return absl::StrCat("/dev/infiniband/", d.uverbs, " not accessible");
  if (p.state != "ACTIVE") return absl::StrCat("port state ", p.state);
  if (p.link_layer != "InfiniBand" && p.link_layer != "Ethernet") {
    return absl::StrCat("link layer '", p.link_layer, "' is neither InfiniBand nor Ethernet");
  }
  if (p.gids.empty()) return "no GID";
  return "";
}

}  // namespace

int RankGid(const std::string& link_layer, GidInfo* g) {
  unsigned char raw[16] = {};
  ParseGid(g->gid, raw);
  if (link_layer == "InfiniBand") {
    g->rank = 2;
    g->why = "InfiniBand port GID";
    return g->rank;
  }
  const bool v2 = g->type == "RoCE v2";
  const bool mapped = std::all_of(raw, raw + 10, [](unsigned char c) { return c == 0; }) &&
                      raw[10] == 0xff && raw[11] == 0xff;
  const bool link_local = raw[0] == 0xfe && (raw[1] & 0xc0) == 0x80;
  const bool v6_loopback =
      std::all_of(raw, raw + 15, [](unsigned char c) { return c == 0; }) && raw[15] == 1;
  if (mapped) {
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, raw + 12, text, sizeof text);
    g->ipv4 = text;
  }
  const bool v4_loopback = mapped && raw[12] == 127;
  const bool v4_link_local = mapped && raw[12] == 169 && raw[13] == 254;
  if (!v2) {
    g->rank = 5;
    g->why = "RoCE v1 (not routable; used only when nothing better exists)";
  } else if (mapped && !v4_loopback && !v4_link_local) {
    g->rank = 0;
    g->why = absl::StrCat("RoCE v2, routable IPv4 ", g->ipv4);
  } else if (!mapped && !link_local && !v6_loopback) {
    g->rank = 1;
    g->why = "RoCE v2, global IPv6";
  } else if (v4_loopback || v6_loopback) {
    g->rank = 3;
    g->why = "RoCE v2, loopback address";
  } else {
    g->rank = 4;
    g->why = "RoCE v2, link-local";
  }
  return g->rank;
}

int PciDistance(const std::string& a, const std::string& b) { return topology::PciDistance(a, b); }

void ApplyEnvironment(DiscoveryOptions* options) {
  if (options->gid_index >= 0) return;
  for (const char* name : {"MC_GID_INDEX", "NCCL_IB_GID_INDEX"}) {
    int v;
    const char* text = std::getenv(name);
    if (text != nullptr && absl::SimpleAtoi(text, &v) && v >= 0) {
      options->gid_index = v;
      options->gid_index_source = name;
      return;
    }
  }
}

namespace {

// Every device the filter names exists and has an ACTIVE port.
absl::Status CheckNamed(const Filter& filter, const std::vector<DeviceInfo>& devices) {
  for (const Filter::Entry& e : filter.allow) {
    auto dev = std::find_if(devices.begin(), devices.end(),
                            [&](const DeviceInfo& x) { return x.name == e.device; });
    if (dev == devices.end()) {
      return absl::NotFoundError(absl::StrCat("RDMA device '", e.device,
                                              "' does not exist; available: ", Available(devices)));
    }
    const bool active = std::any_of(dev->ports.begin(), dev->ports.end(), [&](const PortInfo& p) {
      return (e.port == 0 || p.port == e.port) && Unusable(*dev, p).empty();
    });
    if (!active) {
      return absl::FailedPreconditionError(
          absl::StrCat("RDMA device '", e.device, e.port ? absl::StrCat(":", e.port) : "",
                       "' has no usable ACTIVE port; available: ", Available(devices)));
    }
  }
  return absl::OkStatus();
}

// The GID port `where` uses: the one the options name, else the best
// ranked (lower rank, then the port's own netdev, then the lowest index);
// `why` says which and why.
absl::StatusOr<const GidInfo*> ChooseGid(const PortInfo& p, const DiscoveryOptions& options,
                                         const std::string& where, std::string* why) {
  const GidInfo* gid = nullptr;
  if (options.gid_index >= 0) {
    for (const GidInfo& g : p.gids) {
      if (g.index == static_cast<uint32_t>(options.gid_index)) gid = &g;
    }
    if (gid == nullptr) {
      std::vector<std::string> have;
      for (const GidInfo& g : p.gids) have.push_back(absl::StrCat(g.index));
      return absl::InvalidArgumentError(
          absl::StrCat("GID index ", options.gid_index, " (from ", options.gid_index_source,
                       ") does not exist on ", where, "; it has ", absl::StrJoin(have, ", ")));
    }
    *why = absl::StrCat("GID ", gid->index, " set by ", options.gid_index_source);
    return gid;
  }
  for (const GidInfo& g : p.gids) {
    if (gid == nullptr || g.rank < gid->rank ||
        (g.rank == gid->rank && gid->foreign && !g.foreign)) {
      gid = &g;
    }
  }
  *why = absl::StrCat("GID ", gid->index, ": ", gid->why);
  return gid;
}

}  // namespace

absl::StatusOr<Discovery> Discover(const DiscoveryOptions& options) {
  Discovery d;
  const fs::path root = options.sysfs_root;
  for (const std::string& name : List(root / "class" / "infiniband")) {
    d.devices.push_back(ReadDevice(root, name, options.dev_root));
  }
  d.gpus = ReadGpus(root);
  absl::StatusOr<Filter> filter = ParseFilter(options.devices);
  if (!filter.ok()) return filter.status();
  RETURN_IF_ERROR(CheckNamed(*filter, d.devices));
  for (const DeviceInfo& dev : d.devices) {
    for (const PortInfo& p : dev.ports) {
      const std::string where = absl::StrCat(dev.name, ":", p.port);
      if (!filter->allow.empty() && !Matches(filter->allow, dev.name, p.port)) {
        d.notes.push_back(absl::StrCat(where, " skipped: not in the device list"));
        continue;
      }
      if (Matches(filter->exclude, dev.name, p.port)) {
        d.notes.push_back(absl::StrCat(where, " skipped: excluded"));
        continue;
      }
      if (std::string why = Unusable(dev, p); !why.empty()) {
        d.notes.push_back(absl::StrCat(where, " skipped: ", why));
        continue;
      }
      std::string why;
      ASSIGN_OR_RETURN(const GidInfo* gid, ChooseGid(p, options, where, &why));
      SelectedPort s;
      s.device = dev.name;
      s.port = p.port;
      s.link_layer = p.link_layer;
      s.gid_index = gid->index;
      s.gid = gid->gid;
      s.netdev = gid->netdev;
      s.ipv4 = gid->ipv4;
      s.numa_node = dev.numa_node;
      s.pci_path = dev.pci_path;
      s.why = why;
      d.notes.push_back(absl::StrCat(where, " selected: ", p.link_layer, ", ", why));
      d.selected.push_back(std::move(s));
    }
  }
  return d;
}

absl::StatusOr<std::vector<SelectedPort>> NearestPorts(const Discovery& d,
                                                       const std::string& location,
                                                       std::vector<int>* distances) {
  ASSIGN_OR_RETURN(const topology::Location where, topology::ParseLocation(location));
  std::vector<std::pair<int, SelectedPort>> scored;
  const GpuInfo* gpu = nullptr;
  switch (where.kind) {
    case topology::Location::Kind::kAny:
      for (const SelectedPort& p : d.selected) scored.emplace_back(0, p);
      break;
    case topology::Location::Kind::kCpu:
      for (const SelectedPort& p : d.selected) {
        scored.emplace_back(p.numa_node == where.index ? 0 : 1, p);
      }
      break;
    case topology::Location::Kind::kCuda:
      for (const GpuInfo& g : d.gpus) gpu = g.name == where.ToString() ? &g : gpu;
      if (gpu == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("no GPU ", location, " (found ", d.gpus.size(), ")"));
      }
      break;
    case topology::Location::Kind::kPci:
      // A GPU by its PCI address (what the CUDA driver reports for a device
      // ordinal: right under CUDA_VISIBLE_DEVICES and in containers).
      for (const GpuInfo& g : d.gpus) {
        gpu = absl::AsciiStrToLower(g.pci_address) == where.pci_address ? &g : gpu;
      }
      if (gpu == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("no GPU at PCI address ", where.pci_address, " in sysfs"));
      }
      break;
  }
  if (gpu != nullptr) {
    for (const SelectedPort& p : d.selected) {
      scored.emplace_back(topology::PciDistance(gpu->pci_path, p.pci_path), p);
    }
  }
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<SelectedPort> out;
  if (distances != nullptr) distances->clear();
  for (auto& [score, p] : scored) {
    out.push_back(std::move(p));
    if (distances != nullptr) distances->push_back(score);
  }
  return out;
}

std::string TopologyJson(const Discovery& d) {
  std::set<std::string> locations;
  for (const auto& port : d.selected) {
    locations.insert(absl::StrCat("cpu:", std::max(0, port.numa_node)));
  }
  for (const auto& gpu : d.gpus) locations.insert(gpu.name);
  auto list = [](const std::vector<std::string>& names) {
    std::vector<std::string> quoted;
    for (const std::string& n : names) quoted.push_back(absl::StrCat("\"", n, "\""));
    return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
  };
  std::vector<std::string> entries;
  for (const std::string& loc : locations) {
    std::vector<int> distance;
    absl::StatusOr<std::vector<SelectedPort>> ports = NearestPorts(d, loc, &distance);
    if (!ports.ok() || ports->empty()) continue;
    std::vector<std::string> near, far;
    for (size_t i = 0; i < ports->size(); ++i) {
      auto& bucket = distance[i] == distance[0] ? near : far;
      if (std::find(near.begin(), near.end(), (*ports)[i].device) == near.end() &&
          std::find(far.begin(), far.end(), (*ports)[i].device) == far.end()) {
        bucket.push_back((*ports)[i].device);
      }
    }
    entries.push_back(absl::StrCat("\"", loc, "\": [", list(near), ", ", list(far), "]"));
  }
  return absl::StrCat("{", absl::StrJoin(entries, ", "), "}");
}

}  // namespace verbs
}  // namespace transport
}  // namespace kvferry
