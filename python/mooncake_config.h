// The Mooncake surface's configuration (kvferry.TransferEngine,
// mooncake_engine.cc): the MC_* environment variables, the names peers are
// given by.
#ifndef KVFERRY_PYTHON_MOONCAKE_CONFIG_H_
#define KVFERRY_PYTHON_MOONCAKE_CONFIG_H_

#include <cstdint>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/transfer_engine.h"
#include "transport/verbs/discovery.h"

namespace kvferry {
namespace python {

// The variable is set, and not "", "0" or "false" (any case).
bool EnvOn(const char* name);

// The MC_* variables kvferry reads (here or in RDMA discovery), and those it
// accepts without needing them. Any other MC_* variable that is set is named
// in one warning: Mooncake tuning that kvferry sizes itself.
const std::set<std::string>& KnownMooncakeVariables();

// Applies the MC_* variables to `o` (docs/migrating-from-mooncake.md); an
// error names a value out of range.
absl::Status ApplyMooncakeEnvironment(EngineOptions* o);

// MC_TRANSFER_TIMEOUT as Mooncake reads it: seconds, at least 5, default
// 30; an error for a value that is not a number from 0 to 86400.
absl::StatusOr<absl::Duration> TransferTimeout();

// A target as Mooncake callers write it ("host:port", "[v6]:port", or an
// IPv6 address and port without brackets) -> the "host:port" kvferry's
// handshake uses (IPv6 in brackets); anything else is returned unchanged
// and fails where it is used.
std::string PeerName(const std::string& target);

}  // namespace python
}  // namespace kvferry

#endif  // KVFERRY_PYTHON_MOONCAKE_CONFIG_H_
