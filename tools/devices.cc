// kvferry devices: what RDMA hardware this host has and what kvferry's
// auto-discovery would use, with the reasons; and the GPUs by CUDA ordinal
// (as the CUDA driver numbers them, honouring CUDA_VISIBLE_DEVICES) with
// whether dma-buf and nvidia-peermem can register their memory for RDMA.
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
#include "cuda/driver.h"
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

// A GPU as the CUDA driver sees it.
struct CudaGpu {
  int ordinal = 0;
  std::string pci;       // lower case
  bool dma_buf = false;  // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
  bool gpudirect = false;
  bool vmm_fds = false;  // VMM memory shareable as POSIX fds (to same-host peers)
  std::string nearest;   // the nearest selected RDMA port's device
};

struct CudaView {
  std::string error;  // why there is no driver
  std::string library;
  int version = 0;
  bool peermem = false;  // the nvidia-peermem module is loaded
  std::vector<CudaGpu> gpus;
};

CudaView ReadCuda(const Discovery& d, const std::string& sysfs_root) {
  CudaView v;
  for (const char* module : {"nvidia_peermem", "nv_peer_mem"}) {
    FILE* f = std::fopen(absl::StrCat(sysfs_root, "/module/", module, "/initstate").c_str(), "r");
    if (f != nullptr) {
      v.peermem = true;
      std::fclose(f);
    }
  }
  const cuda::Driver* driver = cuda::Driver::Get();
  if (driver == nullptr) {
    v.error = std::string(cuda::Driver::LoadError().message());
    return v;
  }
  v.library = driver->library();
  v.version = driver->version();
  for (int i = 0; i < driver->device_count(); ++i) {
    CudaGpu g;
    g.ordinal = i;
    g.pci = driver->PciBusId(i).value_or("?");
    g.dma_buf = driver->Attribute(i, cuda::api::kDeviceAttributeDmaBufSupported) == 1;
    g.gpudirect = driver->Attribute(i, cuda::api::kDeviceAttributeGpuDirectRdmaSupported) == 1;
    g.vmm_fds =
        driver->HasVmm() &&
        driver->Attribute(i, cuda::api::kDeviceAttributeVirtualMemoryManagementSupported) == 1 &&
        driver->Attribute(i, cuda::api::kDeviceAttributeHandleTypePosixFileDescriptorSupported) == 1;
    auto near = transport::verbs::NearestPorts(d, "pci:" + g.pci);
    if (near.ok() && !near->empty()) g.nearest = (*near)[0].device;
    v.gpus.push_back(g);
  }
  return v;
}

std::string CudaJson(const CudaView& v) {
  std::vector<std::string> gpus;
  for (const CudaGpu& g : v.gpus) {
    gpus.push_back(absl::StrCat("{\"ordinal\":", g.ordinal, ",\"pci\":", Quote(g.pci),
                                ",\"dma_buf\":", g.dma_buf ? "true" : "false",
                                ",\"gpudirect_rdma\":", g.gpudirect ? "true" : "false",
                                ",\"vmm_fds\":", g.vmm_fds ? "true" : "false",
                                ",\"nearest\":", Quote(g.nearest), "}"));
  }
  return absl::StrCat("{\"library\":", Quote(v.library), ",\"version\":", v.version,
                      ",\"error\":", Quote(v.error), ",\"peermem\":",
                      v.peermem ? "true" : "false", ",\"gpus\":[", absl::StrJoin(gpus, ","),
                      "]}");
}

void PrintCudaText(const CudaView& v) {
  if (!v.error.empty()) {
    std::printf("\nCUDA: none (%s): GPU memory cannot be registered on this host.\n",
                v.error.c_str());
    return;
  }
  std::printf("\nCUDA driver %d.%d (%s), nvidia-peermem %s:\n", v.version / 1000,
              v.version % 1000 / 10, v.library.c_str(), v.peermem ? "loaded" : "not loaded");
  for (const CudaGpu& g : v.gpus) {
    std::printf("  cuda:%d  PCI %s  dma-buf %s  GPUDirect RDMA %s  nearest NIC %s\n", g.ordinal,
                g.pci.c_str(), g.dma_buf ? "yes" : "no", g.gpudirect ? "yes" : "no",
                g.nearest.empty() ? "(none)" : g.nearest.c_str());
    const char* path = g.dma_buf   ? "dma-buf"
                       : v.peermem ? "ibv_reg_mr through nvidia-peermem"
                                   : nullptr;
    if (path != nullptr) {
      std::printf("    RDMA registers its memory by %s\n", path);
    } else {
      std::printf("    RDMA cannot register its memory (no dma-buf, no nvidia-peermem): "
                  "TCP stages it through host memory\n");
    }
    std::printf("    same-host peers: cudaMalloc memory through CUDA IPC handles, VMM memory "
                "(expandable segments) %s\n",
                g.vmm_fds ? "through POSIX fds" : "staged (no VMM POSIX fd handles)");
  }
}

void PrintJson(const Discovery& d, const CudaView& cuda) {
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
  std::printf(
      "{\"devices\":[%s],\"gpus\":[%s],\"selected\":[%s],\"notes\":[%s],\"cuda\":%s}\n",
      absl::StrJoin(devices, ",").c_str(), absl::StrJoin(gpus, ",").c_str(),
      absl::StrJoin(selected, ",").c_str(), absl::StrJoin(notes, ",").c_str(),
      CudaJson(cuda).c_str());
}

void PrintText(const Discovery& d, const std::string& root, const CudaView& cuda) {
  if (d.devices.empty()) {
    std::printf("No RDMA devices under %s/class/infiniband: kvferry will use TCP.\n",
                root.c_str());
    PrintCudaText(cuda);
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
  PrintCudaText(cuda);
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "lists RDMA devices and what kvferry's auto-discovery selects, and the GPUs by CUDA "
      "ordinal (KVFERRY_CUDA_LIBRARY names another CUDA driver library).");
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
  const kvferry::CudaView cuda = kvferry::ReadCuda(*d, o.sysfs_root);
  if (absl::GetFlag(FLAGS_json)) {
    kvferry::PrintJson(*d, cuda);
  } else {
    kvferry::PrintText(*d, o.sysfs_root, cuda);
  }
  return 0;
}
