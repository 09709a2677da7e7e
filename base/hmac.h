// HMAC-SHA256 (OpenSSL's libcrypto), for the handshake's authentication and
// the TCP data connections' hello.
#ifndef KVFERRY_BASE_HMAC_H_
#define KVFERRY_BASE_HMAC_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvferry {

// The 32-byte HMAC-SHA256 of `data` under `key`.
std::string HmacSha256(absl::string_view key, absl::string_view data);

// Compares two tags in constant time.
bool SameTag(absl::string_view a, absl::string_view b);

}  // namespace kvferry

#endif  // KVFERRY_BASE_HMAC_H_
