#include "topology/location.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvferry {
namespace topology {

Location Location::Pci(absl::string_view address) {
  return Location{Kind::kPci, 0, absl::AsciiStrToLower(address)};
}

std::string Location::ToString() const {
  switch (kind) {
    case Kind::kAny:
      return "";
    case Kind::kCpu:
      return absl::StrCat("cpu:", index);
    case Kind::kCuda:
      return absl::StrCat("cuda:", index);
    case Kind::kPci:
      return absl::StrCat("pci:", pci_address);
  }
  return "";
}

absl::StatusOr<Location> ParseLocation(absl::string_view text) {
  if (text.empty()) return Location{};
  const size_t colon = text.find(':');
  const absl::string_view kind = text.substr(0, colon);
  const absl::string_view rest = colon == absl::string_view::npos ? "" : text.substr(colon + 1);
  int n = -1;
  if ((kind == "cpu" || kind == "cuda") && absl::SimpleAtoi(rest, &n) && n >= 0) {
    return kind == "cpu" ? Location::Cpu(n) : Location::Cuda(n);
  }
  if (kind == "pci" && !rest.empty()) return Location::Pci(rest);
  return absl::InvalidArgumentError(
      absl::StrCat("bad location '", text, "' (expected cpu:N, cuda:N or pci:<address>, N >= 0)"));
}

int PciDistance(absl::string_view a, absl::string_view b) {
  std::vector<absl::string_view> pa = absl::StrSplit(a, '/', absl::SkipEmpty());
  std::vector<absl::string_view> pb = absl::StrSplit(b, '/', absl::SkipEmpty());
  size_t common = 0;
  while (common < pa.size() && common < pb.size() && pa[common] == pb[common]) ++common;
  return static_cast<int>((pa.size() - common) + (pb.size() - common));
}

}  // namespace topology
}  // namespace kvferry
