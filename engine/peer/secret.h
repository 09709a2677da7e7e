// Where the handshake secret comes from, and the warning an engine without
// one gives when it is reachable from the network.
#ifndef KVFERRY_ENGINE_PEER_SECRET_H_
#define KVFERRY_ENGINE_PEER_SECRET_H_

#include <string>

#include "absl/status/statusor.h"

namespace kvferry {
namespace engine_internal {

// The file engines read the secret from when KVFERRY_SECRET is unset.
inline constexpr char kSecretFileEnv[] = "KVFERRY_SECRET_FILE";

// `configured` (EngineOptions::secret) if set; else KVFERRY_SECRET; else the
// contents of the file KVFERRY_SECRET_FILE names (one trailing newline
// dropped); else "" (no authentication). kInvalidArgument when both
// variables are set, or the file is empty; the file's errno otherwise.
absl::StatusOr<std::string> ResolveSecret(const std::string& configured);

// Logs one warning when an engine listening on `bind_host` has no secret
// and is reachable from other hosts. Returns whether it warned.
bool WarnIfUnauthenticated(bool has_secret, const std::string& bind_host);

}  // namespace engine_internal
}  // namespace kvferry

#endif  // KVFERRY_ENGINE_PEER_SECRET_H_
