#include "python/module_util.h"

#include <arpa/inet.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace py = pybind11;

namespace kvferry {
namespace python {

PyObject* g_error = nullptr;  // kvferry.Error, created at import

void Raise(const absl::Status& s) {
  py::object error = py::reinterpret_borrow<py::object>(g_error);
  py::object instance = error(std::string(s.message()));
  instance.attr("code") = absl::StatusCodeToString(s.code());
  PyErr_SetObject(g_error, instance.ptr());
  throw py::error_already_set();
}

absl::StatusOr<transport::Access> ParseAccess(const std::string& text) {
  if (text == "w") return transport::Access::kRemoteWrite;
  if (text == "r") return transport::Access::kRemoteRead;
  if (text == "rw") return transport::Access::kRemoteReadWrite;
  if (text == "none") return transport::Access::kNone;
  return absl::InvalidArgumentError(absl::StrCat(
      "access '", text, "': \"w\" (peers may write), \"r\", \"rw\" or \"none\""));
}

namespace {

bool IsIpv6(const std::string& text) {
  in6_addr addr;
  return inet_pton(AF_INET6, text.substr(0, text.find('%')).c_str(), &addr) == 1;
}

}  // namespace

absl::Status SplitHostPort(const std::string& in, std::string* host, uint16_t* port) {
  *host = in;
  *port = 0;
  std::string port_text;
  if (!in.empty() && in[0] == '[') {
    const size_t close = in.find(']');
    if (close == std::string::npos || (close + 1 < in.size() && in[close + 1] != ':')) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", in, "': an IPv6 address in brackets is \"[addr]\" or \"[addr]:port\""));
    }
    *host = in.substr(1, close - 1);
    if (close + 1 < in.size()) port_text = in.substr(close + 2);
  } else if (const size_t colon = in.find(':');
             colon != std::string::npos && in.find(':', colon + 1) == std::string::npos) {
    *host = in.substr(0, colon);  // "host:port"
    port_text = in.substr(colon + 1);
  } else if (colon != std::string::npos && !IsIpv6(in)) {
    // Several colons and not an address: an IPv6 address and a port
    // without brackets ("fe80::1:15001", as f"{ip}:{port}" builds it),
    // split at the last colon as Mooncake does.
    const size_t last = in.rfind(':');
    if (!IsIpv6(in.substr(0, last))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", in, "' is neither host:port nor an IPv6 address (with a port: [addr]:port)"));
    }
    *host = in.substr(0, last);
    port_text = in.substr(last + 1);
  }
  if (port_text.empty()) return absl::OkStatus();
  uint32_t p = 0;
  if (!absl::SimpleAtoi(port_text, &p) || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", in, "': port '", port_text,
                                                   "' is not a number from 0 to 65535"));
  }
  *port = static_cast<uint16_t>(p);
  return absl::OkStatus();
}

absl::Status RunBatch(TransferEngine& engine, const std::string& peer,
                      const std::vector<TransferRequest>& requests, absl::Duration timeout) {
  py::gil_scoped_release release;
  absl::StatusOr<SegmentId> seg = engine.OpenSegment(peer);
  if (!seg.ok()) return seg.status();
  absl::StatusOr<BatchId> batch = engine.Submit(*seg, requests);
  if (!batch.ok()) return batch.status();
  absl::StatusOr<BatchStatus> st = engine.Wait(*batch, timeout);
  if (!st.ok()) return st.status();
  (void)engine.Release(*batch);
  for (size_t i = 0; i < st->requests.size(); ++i) {
    if (!st->requests[i].ok()) {
      return absl::Status(st->requests[i].code(),
                          absl::StrCat("request ", i, ": ", st->requests[i].message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace python
}  // namespace kvferry
