// Where memory lives and how far apart devices are: the one parser of
// locations ("cpu:N", "cuda:N", "pci:<address>") the engine, the verbs
// discovery and the bindings share, and the PCIe distance NICs are ranked
// by. Pure functions: no I/O, no state.
#ifndef KVFERRY_TOPOLOGY_LOCATION_H_
#define KVFERRY_TOPOLOGY_LOCATION_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvferry {
namespace topology {

struct Location {
  enum class Kind {
    kAny,   // "": no preference
    kCpu,   // "cpu:N": host memory on NUMA node N
    kCuda,  // "cuda:N": memory of CUDA device N (the driver's ordinal)
    kPci,   // "pci:<address>": memory of the GPU at that PCI address
  };
  Kind kind = Kind::kAny;
  int index = 0;            // kCpu: the NUMA node; kCuda: the ordinal
  std::string pci_address;  // kPci: lower case, as sysfs writes it

  static Location Cpu(int node) { return Location{Kind::kCpu, node, ""}; }
  static Location Cuda(int ordinal) { return Location{Kind::kCuda, ordinal, ""}; }
  static Location Pci(absl::string_view address);
  // The text ParseLocation reads back.
  std::string ToString() const;
  bool operator==(const Location& o) const {
    return kind == o.kind && index == o.index && pci_address == o.pci_address;
  }
};

// `text` as a location; kInvalidArgument (quoting it, and saying what is
// expected) for anything else. A negative or non-numeric N is refused.
absl::StatusOr<Location> ParseLocation(absl::string_view text);

// The hops between two devices' PCIe paths (sysfs paths such as
// "pci0000:00/0000:00:01.0/0000:01:00.0"): up from one to the last bridge
// they share, then down to the other. 0: the same device.
int PciDistance(absl::string_view a, absl::string_view b);

}  // namespace topology
}  // namespace kvferry

#endif  // KVFERRY_TOPOLOGY_LOCATION_H_
