// Helpers shared by the kvferry Python module's files (kvferry_module.cc,
// mooncake_engine.cc): errors as kvferry.Error, batches run without the GIL,
// access strings, host:port parsing.
#ifndef KVFERRY_PYTHON_MODULE_UTIL_H_
#define KVFERRY_PYTHON_MODULE_UTIL_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/transfer_engine.h"
#include "net/socket.h"

namespace kvferry {
namespace python {

// kvferry.Error, set when the module is imported.
extern PyObject* g_error;

// Raises kvferry.Error (its .code is the status code's name).
[[noreturn]] void Raise(const absl::Status& s);

template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

inline void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

// "w" (peers may write, not read), "r", "rw" or "none".
absl::StatusOr<transport::Access> ParseAccess(const std::string& text);

// net::ParseHostPort's forms ("host:port", "[v6]:port"), plus those Mooncake
// callers use: no port ("host", "[v6]", a bare IPv6 address: port 0) and an
// IPv6 address and port without brackets when the whole is not an address
// ("fe80::1:15001", split at the last colon). kInvalidArgument otherwise.
absl::StatusOr<net::HostPort> SplitHostPort(const std::string& in);

// Opens (or reuses) the segment to `peer`, runs `requests` as one batch and
// waits for it, without the GIL. The first failed request's status, naming
// it.
absl::Status RunBatch(TransferEngine& engine, const std::string& peer,
                      const std::vector<TransferRequest>& requests, absl::Duration timeout);

}  // namespace python
}  // namespace kvferry

#endif  // KVFERRY_PYTHON_MODULE_UTIL_H_
