// The Mooncake surface's configuration: the MC_* environment, peer names
// and the topology JSON (see mooncake_config.h).
#include "python/mooncake_config.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "python/module_util.h"

extern char** environ;

namespace kvferry {
namespace python {

// Set, and not "", "0" or "false".
bool EnvOn(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const std::string s = absl::AsciiStrToLower(v);
  return !s.empty() && s != "0" && s != "false";
}

namespace {

// An integer variable within [lo, hi]; *set false when absent.
absl::Status EnvInt(const char* name, int64_t lo, int64_t hi, int64_t* out, bool* set) {
  const char* v = std::getenv(name);
  *set = v != nullptr;
  if (v == nullptr) return absl::OkStatus();
  if (!absl::SimpleAtoi(v, out) || *out < lo || *out > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", v, "': an integer from ", lo, " to ", hi, " is expected"));
  }
  return absl::OkStatus();
}

}  // namespace

// The MC_* variables kvferry reads (here or in RDMA discovery), and those
// it accepts without needing them. Any other MC_* variable that is set is
// named in one warning: Mooncake tuning that kvferry sizes itself.
const std::set<std::string>& KnownMooncakeVariables() {
  static const auto* known = new std::set<std::string>{
      "MC_FORCE_TCP",      "MC_FORCE_HCA",       "MC_GID_INDEX",
      "MC_TRANSFER_TIMEOUT", "MC_SLICE_SIZE",    "MC_NUM_QP_PER_EP",
      "MC_HANDSHAKE_CONNECT_TIMEOUT", "MC_TCP_BIND_ADDRESS", "MC_MIN_RPC_PORT",
      "MC_MAX_RPC_PORT",   "MC_MIN_PRC_PORT",    "MC_MAX_PRC_PORT",
      "MC_LOG_LEVEL",      "MC_USE_IPV6",        "MC_LEGACY_RPC_PORT_BINDING",
      "MC_TE_METRIC",      "MC_METADATA_SERVER",
  };
  return *known;
}

absl::StatusOr<absl::Duration> TransferTimeout() {
  int64_t seconds = 30;
  bool set = false;
  RETURN_IF_ERROR(EnvInt("MC_TRANSFER_TIMEOUT", 0, 86400, &seconds, &set));
  return absl::Seconds(std::max<int64_t>(5, seconds));
}

// Applies the MC_* variables to `o`; an error names a value out of range.
absl::Status ApplyMooncakeEnvironment(EngineOptions* o) {
  int64_t v = 0;
  bool set = false;
  RETURN_IF_ERROR(EnvInt("MC_SLICE_SIZE", 4096, int64_t{1} << 30, &v, &set));
  if (set) o->slice_bytes = static_cast<uint64_t>(v);
  RETURN_IF_ERROR(EnvInt("MC_NUM_QP_PER_EP", 1, 64, &v, &set));
  if (set) o->links_per_peer = static_cast<uint32_t>(v);
  RETURN_IF_ERROR(EnvInt("MC_HANDSHAKE_CONNECT_TIMEOUT", 1, 3599, &v, &set));
  if (set) o->handshake_timeout = absl::Seconds(v);
  int64_t lo = o->first_port, hi = o->last_port;
  for (const char* name : {"MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"}) {
    RETURN_IF_ERROR(EnvInt(name, 1, 65535, &v, &set));
    if (set) {
      lo = v;
      break;
    }
  }
  for (const char* name : {"MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"}) {
    RETURN_IF_ERROR(EnvInt(name, 1, 65535, &v, &set));
    if (set) {
      hi = v;
      break;
    }
  }
  if (lo > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("MC_MIN_RPC_PORT ", lo, " is above MC_MAX_RPC_PORT ", hi));
  }
  o->first_port = static_cast<uint16_t>(lo);
  o->last_port = static_cast<uint16_t>(hi);
  if (const char* bind = std::getenv("MC_TCP_BIND_ADDRESS"); bind != nullptr && *bind != '\0') {
    o->bind_host = bind;
  }
  if (EnvOn("MC_TE_METRIC")) o->metrics_port = 0;  // Prometheus on a free loopback port
  if (const char* level = std::getenv("MC_LOG_LEVEL"); level != nullptr) {
    const std::string l = absl::AsciiStrToLower(level);
    LogSeverity s;
    if (!ParseLogSeverity(l == "trace" ? "debug" : l, &s)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MC_LOG_LEVEL='", level, "': TRACE, INFO, WARNING or ERROR is expected"));
    }
    SetLogThreshold(s);
  }
  std::vector<std::string> ignored;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    if (!absl::StartsWith(entry, "MC_")) continue;
    const std::string name(entry.substr(0, entry.find('=')));
    if (KnownMooncakeVariables().count(name) == 0) ignored.push_back(name);
  }
  if (!ignored.empty()) {
    std::sort(ignored.begin(), ignored.end());
    KVF_LOG(WARNING) << "kvferry: ignoring Mooncake tuning variable(s) "
                     << absl::StrJoin(ignored, ", ")
                     << ": kvferry sizes queues, CQs and workers itself "
                        "(docs/migrating-from-mooncake.md)";
  }
  return absl::OkStatus();
}

std::string PeerName(const std::string& target) {
  absl::StatusOr<net::HostPort> hp = SplitHostPort(target);
  return hp.ok() && hp->port != 0 ? hp->ToString() : target;
}

}  // namespace python
}  // namespace kvferry
