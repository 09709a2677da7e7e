#include "python/module_util.h"

#include <arpa/inet.h>

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

bool IsIpv6(absl::string_view text) {
  in6_addr addr;
  const std::string literal(text.substr(0, text.find('%')));
  return inet_pton(AF_INET6, literal.c_str(), &addr) == 1;
}

}  // namespace

absl::StatusOr<net::HostPort> SplitHostPort(const std::string& in) {
  // The forms without a port: a host name, "[v6]", a bare IPv6 address.
  if (IsIpv6(in)) return net::HostPort{in, 0};
  if (in.size() > 2 && in.front() == '[' && in.back() == ']') {
    return net::HostPort{in.substr(1, in.size() - 2), 0};
  }
  if (in.find(':') == std::string::npos) return net::HostPort{in, 0};
  absl::StatusOr<net::HostPort> hp = net::ParseHostPort(in);
  if (hp.ok()) return hp;
  // An IPv6 address and a port without brackets ("fe80::1:15001", as
  // f"{ip}:{port}" builds it), split at the last colon as Mooncake does.
  const size_t last = in.rfind(':');
  if (in.front() != '[' && IsIpv6(absl::string_view(in).substr(0, last))) {
    return net::ParseHostPort(absl::StrCat("[", in.substr(0, last), "]", in.substr(last)));
  }
  return hp.status();
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
