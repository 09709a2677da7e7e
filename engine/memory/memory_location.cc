#include "engine/memory/memory_location.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "topology/location.h"

namespace kvferry {
namespace engine_internal {

std::vector<transport::NicIndex> SameNumaNode(const transport::Transport& t,
                                              const std::string& location) {
  std::vector<transport::NicIndex> out;
  absl::StatusOr<topology::Location> l = topology::ParseLocation(location);
  if (l.ok() && l->kind == topology::Location::Kind::kCpu) {
    const std::vector<transport::NicInfo> nics = t.LocalEndpoint().nics;
    for (transport::NicIndex i = 0; i < nics.size(); ++i) {
      if (nics[i].numa_node == l->index) out.push_back(i);
    }
  }
  return out;
}

absl::StatusOr<std::string> MemoryLocation(void* addr, uint64_t length, const std::string& location,
                                           bool* derived, bool* device) {
  if (addr == nullptr || length == 0) return location;
  const cuda::Driver* driver = cuda::Driver::Get();
  if (driver == nullptr) {
    // No CUDA here: the memory must be host memory the CPU can read (GPU
    // memory, or a freed buffer, would crash the transport later).
    absl::Status readable = cuda::CheckHostReadable(addr, length);
    if (!readable.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RegisterMemory: ", readable.message(),
          " (GPU memory needs the CUDA driver: ", cuda::Driver::LoadError().message(), ")"));
    }
    return location;
  }
  absl::StatusOr<cuda::MemoryInfo> info = driver->Classify(addr, length);
  if (!info.ok()) return Annotate(info.status(), "RegisterMemory");
  absl::StatusOr<topology::Location> said = topology::ParseLocation(location);
  const bool says_cuda = said.ok() && said->kind == topology::Location::Kind::kCuda;
  if (!info->device) {
    if (says_cuda) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterMemory: location '", location, "' but the buffer is host memory"));
    }
    return location;
  }
  const std::string mine = topology::Location::Cuda(info->ordinal).ToString();
  if (!location.empty() && location != mine) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterMemory: location '", location,
                                                   "' but the buffer is memory of ", mine));
  }
  *derived = location.empty();
  *device = true;
  absl::StatusOr<std::string> bus = driver->PciBusId(info->ordinal);
  if (!bus.ok()) return mine;
  return topology::Location::Pci(*bus).ToString();
}

absl::Status CheckLocation(const std::string& location) {
  absl::StatusOr<topology::Location> l = topology::ParseLocation(location);
  if (!l.ok() ||
      (l->kind != topology::Location::Kind::kCpu && l->kind != topology::Location::Kind::kCuda)) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterMemory: bad location '", location, "' (expected cpu:N or cuda:N)"));
  }
  return absl::OkStatus();
}

}  // namespace engine_internal
}  // namespace kvferry
