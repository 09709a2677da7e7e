// Where memory registered on the engine lives, as EngineParts::near_nics
// and RegisterMemory's `location` name it ("cpu:N", "cuda:N", "pci:..."):
// derived from the memory through the CUDA driver where there is one, and
// the NICs near a location.
#ifndef KVFERRY_ENGINE_MEMORY_MEMORY_LOCATION_H_
#define KVFERRY_ENGINE_MEMORY_MEMORY_LOCATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace kvferry {
namespace engine_internal {

// For "cpu:N": the NICs of `t` on NUMA node N (EngineParts::near_nics's
// default); none for any other location.
std::vector<transport::NicIndex> SameNumaNode(const transport::Transport& t,
                                              const std::string& location);
// Where [addr, +length) lives. With a CUDA driver the memory itself says:
// device memory is "pci:<the GPU's PCI address>" (the CUDA ordinal mapped
// by the driver, right under CUDA_VISIBLE_DEVICES), and a `location` that
// contradicts the memory is an error. Without one, `location` as given
// (the memory must be readable host memory). *derived: the location came
// from the memory; *device: the memory is GPU memory.
absl::StatusOr<std::string> MemoryLocation(void* addr, uint64_t length, const std::string& location,
                                           bool* derived, bool* device);
// What a caller may name: "cpu:N" or "cuda:N" (pci: is what the engine
// derives from device memory).
absl::Status CheckLocation(const std::string& location);

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_MEMORY_MEMORY_LOCATION_H_
