#include "transport/link_params.h"

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace transport {

LinkParams& LinkParams::Put(uint8_t tag, uint64_t value) {
  std::string bytes;
  for (; value != 0; value >>= 8) bytes.push_back(static_cast<char>(value & 0xff));
  fields_.emplace_back(tag, std::move(bytes));
  return *this;
}

LinkParams& LinkParams::PutBytes(uint8_t tag, absl::string_view value) {
  fields_.emplace_back(tag, std::string(value.substr(0, 255)));
  return *this;
}

std::string LinkParams::Encode() const {
  std::string out;
  out.push_back(static_cast<char>(kVersion));
  out.push_back(static_cast<char>(kind_.size()));
  out += kind_;
  for (const auto& [tag, value] : fields_) {
    out.push_back(static_cast<char>(tag));
    out.push_back(static_cast<char>(value.size()));
    out += value;
  }
  return out;
}

absl::StatusOr<std::string> LinkParams::KindOf(absl::string_view bytes) {
  const size_t kind_size = bytes.size() < 2 ? 0 : static_cast<uint8_t>(bytes[1]);
  if (bytes.size() < 2 || static_cast<uint8_t>(bytes[0]) != kVersion ||
      bytes.size() < 2 + kind_size) {
    return absl::InvalidArgumentError(
        "link parameters: no transport kind (malformed or another version)");
  }
  return std::string(bytes.substr(2, kind_size));
}

absl::StatusOr<LinkParams> LinkParams::Decode(absl::string_view bytes, absl::string_view kind) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("link parameters: ", why));
  };
  if (bytes.size() < 2) return bad(absl::StrCat("too short (", bytes.size(), " bytes)"));
  const uint8_t version = static_cast<uint8_t>(bytes[0]);
  if (version != kVersion) {
    return bad(absl::StrCat("version ", version, ", this engine reads version ", kVersion,
                            " (peers must run compatible kvferry releases)"));
  }
  const size_t kind_len = static_cast<uint8_t>(bytes[1]);
  if (bytes.size() < 2 + kind_len) return bad("truncated transport kind");
  const absl::string_view theirs = bytes.substr(2, kind_len);
  if (theirs != kind) {
    return bad(absl::StrCat("made by the ", theirs, " transport, not ", kind));
  }
  LinkParams out{std::string(kind)};
  for (size_t at = 2 + kind_len; at < bytes.size();) {
    if (bytes.size() - at < 2) return bad("truncated field");
    const uint8_t tag = static_cast<uint8_t>(bytes[at]);
    const size_t len = static_cast<uint8_t>(bytes[at + 1]);
    if (bytes.size() - at - 2 < len) return bad(absl::StrCat("field ", tag, " truncated"));
    if (out.Find(tag) != nullptr) return bad(absl::StrCat("field ", tag, " twice"));
    out.fields_.emplace_back(tag, std::string(bytes.substr(at + 2, len)));
    at += 2 + len;
  }
  return out;
}

const std::string* LinkParams::Find(uint8_t tag) const {
  for (const auto& [t, value] : fields_) {
    if (t == tag) return &value;
  }
  return nullptr;
}

absl::StatusOr<uint64_t> LinkParams::Get(uint8_t tag, absl::string_view name) const {
  const std::string* v = Find(tag);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("link parameters: no ", name));
  }
  if (v->size() > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("link parameters: ", name, " of ", v->size(), " bytes"));
  }
  uint64_t value = 0;
  for (size_t i = v->size(); i-- > 0;) value = (value << 8) | static_cast<uint8_t>((*v)[i]);
  return value;
}

absl::StatusOr<std::string> LinkParams::GetBytes(uint8_t tag, size_t size,
                                                 absl::string_view name) const {
  const std::string* v = Find(tag);
  if (v == nullptr || v->size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("link parameters: ", name, v == nullptr ? " missing" : " of the wrong size"));
  }
  return *v;
}

}  // namespace transport
}  // namespace kvferry
