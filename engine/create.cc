// TransferEngine::Create: zero-configuration start. Detects the address to
// advertise and the RDMA ports (or TCP), builds the transport and the
// handshake network, and assembles the engine with CreateWith. Its own
// target (//engine:engine): the engine core (//engine:core) links no RDMA
// library.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "engine/engine_options.h"
#include "engine/peer/secret.h"
#include "engine/transfer_engine.h"
#include "handshake/tcp_network.h"
#include "net/interfaces.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/verbs/discovery.h"
#include "transport/verbs/ibv.h"
#include "transport/verbs/verbs_transport.h"

namespace kvferry {

using transport::NicIndex;

namespace {

// What Create decided, plus the RDMA ports when it chose RDMA.
struct Decision {
  Detection detection;
  std::vector<transport::verbs::SelectedPort> ports;
  transport::verbs::Discovery discovery;  // when RDMA was looked for
};

// The selected ports (NIC indices of the verbs transport) nearest to
// `location`: every port at the smallest distance.
absl::StatusOr<std::vector<NicIndex>> NearestNics(const transport::verbs::Discovery& d,
                                                  const std::string& location) {
  std::vector<int> distance;
  ASSIGN_OR_RETURN(std::vector<transport::verbs::SelectedPort> ports,
                   transport::verbs::NearestPorts(d, location, &distance));
  std::vector<NicIndex> out;
  for (size_t i = 0; i < ports.size() && distance[i] == distance[0]; ++i) {
    for (NicIndex n = 0; n < d.selected.size(); ++n) {
      if (d.selected[n].device == ports[i].device && d.selected[n].port == ports[i].port) {
        out.push_back(n);
      }
    }
  }
  return out;
}

// Runs RDMA discovery and picks rdma or tcp (options.transport is auto or
// rdma), filling `out`.
absl::Status DetectRdma(const EngineOptions& options, Decision* out) {
  Detection& d = out->detection;
  // rdma-core is loaded at run time: a host without it runs over TCP.
  if (absl::Status loaded = transport::ibv::Load(); !loaded.ok()) {
    // Asked for RDMA, or for devices by name: an error, as for a device
    // that does not exist.
    if (options.transport == "rdma" || !options.devices.empty()) {
      std::vector<std::string> asked;
      if (options.transport == "rdma") asked.push_back("transport=rdma");
      if (!options.devices.empty()) {
        asked.push_back(absl::StrCat("RDMA device(s) ", absl::StrJoin(options.devices, ",")));
      }
      return absl::FailedPreconditionError(
          absl::StrCat(absl::StrJoin(asked, " and "), " asked for, but ", loaded.message(),
                       "; install rdma-core (libibverbs1) or set KVFERRY_IBVERBS_LIBRARY"));
    }
    d.transport = "tcp";
    d.transport_reason = absl::StrCat(loaded.message(), ", TCP");
    return absl::OkStatus();
  }
  transport::verbs::DiscoveryOptions discovery;
  discovery.devices = options.devices;
  if (options.gid_index >= 0) {
    discovery.gid_index = options.gid_index;
    discovery.gid_index_source = "EngineOptions::gid_index";
  }
  transport::verbs::ApplyEnvironment(&discovery);
  // An error here is e.g. a named device that does not exist.
  ASSIGN_OR_RETURN(transport::verbs::Discovery found, transport::verbs::Discover(discovery));
  for (const std::string& note : found.notes) KVF_LOG(INFO) << "rdma discovery: " << note;
  out->ports = found.selected;
  out->discovery = found;
  if (!out->ports.empty()) {
    const transport::verbs::SelectedPort& first = out->ports[0];
    d.transport = "rdma";
    std::vector<std::string> names;
    for (const auto& p : out->ports) names.push_back(absl::StrCat(p.device, ":", p.port));
    d.devices = absl::StrJoin(names, ",");
    d.transport_reason =
        absl::StrCat(options.transport == "rdma" ? "set explicitly; " : "", out->ports.size(),
                     " active RDMA port(s); ", first.device, ":", first.port, " ", first.why);
    return absl::OkStatus();
  }
  if (options.transport == "rdma") {
    return absl::FailedPreconditionError(
        absl::StrCat("transport=rdma but no usable RDMA port was found (",
                     found.devices.empty() ? "no RDMA devices" : absl::StrJoin(found.notes, "; "),
                     "); ./bazelw run //tools:devices explains"));
  }
  d.transport = "tcp";
  d.transport_reason = found.devices.empty() ? "no RDMA devices on this host"
                                             : absl::StrCat("no usable RDMA port (",
                                                            absl::StrJoin(found.notes, "; "), ")");
  return absl::OkStatus();
}

absl::StatusOr<Decision> Detect(const EngineOptions& options) {
  Decision out;
  Detection& d = out.detection;
  if (options.transport != "auto" && options.transport != "tcp" && options.transport != "rdma" &&
      options.transport != "sim") {
    return absl::InvalidArgumentError(absl::StrCat("unknown transport '", options.transport,
                                                   "' (expected auto, tcp, rdma or sim)"));
  }
  if (options.transport == "sim") {
    return absl::InvalidArgumentError(
        "transport=sim needs a simulated fabric: build the engine with CreateWith");
  }
  if (options.transport != "tcp") {
    RETURN_IF_ERROR(DetectRdma(options, &out));
  } else {
    d.transport = "tcp";
    d.transport_reason = "set explicitly";
  }
  if (d.devices.empty()) d.devices = "none (TCP)";
  const std::string rdma_netdev = out.ports.empty() ? "" : out.ports[0].netdev;
  absl::StatusOr<std::vector<net::InterfaceAddress>> addresses = net::ListInterfaceAddresses();
  const net::HostChoice host =
      net::ChooseLocalHost(options.local_host, rdma_netdev,
                           addresses.ok() ? *addresses : std::vector<net::InterfaceAddress>{},
                           net::DefaultRouteInterface());
  d.host = host.host;
  d.host_reason = host.reason;
  d.bind_host = options.bind_host.empty() ? host.host : options.bind_host;
  return out;
}

}  // namespace

// "[v6]" as the engine's own address() writes it: the address inside.
static absl::Status Unbracket(const char* option, std::string* host) {
  if (host->empty() || host->front() != '[') return absl::OkStatus();
  if (host->size() < 3 || host->back() != ']') {
    return absl::InvalidArgumentError(absl::StrCat(
        "EngineOptions::", option, " '", *host,
        "': an IPv6 address in brackets needs its ']' and nothing after it (the port is "
        "EngineOptions::port)"));
  }
  *host = host->substr(1, host->size() - 2);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TransferEngine>> TransferEngine::Create(EngineOptions options) {
  RETURN_IF_ERROR(Unbracket("local_host", &options.local_host));
  RETURN_IF_ERROR(Unbracket("bind_host", &options.bind_host));
  if ((options.local_host == "0.0.0.0" || options.local_host == "::") &&
      options.bind_host.empty()) {
    // Every interface: bound, and the address peers are told is detected
    // (an unspecified address reaches no one).
    KVF_LOG(INFO) << "local_host " << options.local_host
                  << " binds every interface; the advertised address is detected";
    options.bind_host = std::exchange(options.local_host, "");
  }
  RETURN_IF_ERROR(engine_internal::CheckOptions(options));
  // The data connections prove the secret too (TcpTransportOptions::secret).
  ASSIGN_OR_RETURN(options.secret, engine_internal::ResolveSecret(options.secret));
  ASSIGN_OR_RETURN(Decision decision, Detect(options));
  Detection& d = decision.detection;
  KVF_LOG(INFO) << "advertising " << d.host << " (" << d.host_reason << ")";
  KVF_LOG(INFO) << "transport " << d.transport << " (" << d.transport_reason << ")";
  transport::TcpTransportOptions stream;
  stream.bind_host = d.bind_host;
  stream.advertise_host = d.host;
  stream.connect_timeout = options.connect_timeout;
  stream.secret = options.secret;
  auto tcp = [&]() { return transport::CreateTcpTransport(stream); };
  EngineParts parts;
  if (d.transport == "rdma") {
    transport::VerbsTransportOptions v;
    v.ports = decision.ports;
    ASSIGN_OR_RETURN(parts.transport, transport::CreateVerbsTransport(v));
    if (options.transport == "auto") {
      // Peers without RDMA, or whose RDMA path cannot be set up, over TCP.
      ASSIGN_OR_RETURN(parts.fallback, tcp());
      absl::StrAppend(&d.transport_reason, "; TCP beside it for peers RDMA cannot reach");
      KVF_LOG(INFO) << "tcp beside rdma, for peers without RDMA or whose RDMA path fails";
    }
  } else {
    ASSIGN_OR_RETURN(parts.transport, tcp());
  }
  if (cuda::Driver::Get() != nullptr && options.transport != "rdma") {
    // Peers on this host: device memory GPU to GPU (transport/cuda_ipc).
    // "rdma" keeps verbs alone, for same-host peers too.
    transport::CudaIpcTransportOptions ipc;
    ipc.stream = stream;
    ASSIGN_OR_RETURN(parts.same_host, transport::CreateCudaIpcTransport(std::move(ipc)));
    absl::StrAppend(&d.transport_reason, "; cuda_ipc for peers on this host");
  }
  parts.network = handshake::NewTcpNetwork();
  parts.detection = std::move(d);
  if (!decision.ports.empty()) {
    parts.near_nics = [discovery = std::move(decision.discovery)](const std::string& location) {
      return NearestNics(discovery, location);
    };
  }
  return CreateWith(std::move(options), std::move(parts));
}

}  // namespace kvferry
