// The bytes a transport sends through the handshake to set up a link
// (LinkOffer::params), in one versioned format shared by every transport:
//
//   version (1 byte) | kind length (1) | kind | fields...
//   field: tag (1 byte) | length (1 byte) | value (length bytes)
//
// Integers are little-endian and as long as they need (at most 8 bytes).
// A reader refuses another version or another transport kind, a truncated
// or duplicated field, and a missing one it asks for, each with a
// kInvalidArgument that says which; fields it does not know are skipped,
// so a newer writer may add some.
#ifndef KVFERRY_TRANSPORT_LINK_PARAMS_H_
#define KVFERRY_TRANSPORT_LINK_PARAMS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvferry {
namespace transport {

class LinkParams {
 public:
  static constexpr uint8_t kVersion = 1;

  // An empty set of fields for transport `kind` ("verbs", "tcp", "sim").
  explicit LinkParams(std::string kind) : kind_(std::move(kind)) {}
  // The transport kind `bytes` were written by (to route them to it).
  static absl::StatusOr<std::string> KindOf(absl::string_view bytes);
  // Parses `bytes` written for `kind`.
  static absl::StatusOr<LinkParams> Decode(absl::string_view bytes, absl::string_view kind);

  LinkParams& Put(uint8_t tag, uint64_t value);
  LinkParams& PutBytes(uint8_t tag, absl::string_view value);  // at most 255 bytes
  std::string Encode() const;

  // The field `tag` (`name` is for the error message).
  absl::StatusOr<uint64_t> Get(uint8_t tag, absl::string_view name) const;
  // A field of exactly `size` bytes.
  absl::StatusOr<std::string> GetBytes(uint8_t tag, size_t size, absl::string_view name) const;

 private:
  const std::string* Find(uint8_t tag) const;
  std::string kind_;
  std::vector<std::pair<uint8_t, std::string>> fields_;
};

}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_LINK_PARAMS_H_
