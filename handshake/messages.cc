#include "handshake/messages.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "handshake/wire.h"

namespace kvferry {
namespace handshake {
namespace {

absl::Status Malformed(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("malformed ", what, " message"));
}

void WriteNic(Writer& w, const transport::NicInfo& nic) {
  w.Bytes(nic.name);
  w.Bytes(nic.address);
  w.I32(nic.numa_node);
  w.U64(nic.link_bits_per_sec);
  w.U32(nic.mtu);
}

bool ReadNic(Reader& r, transport::NicInfo* nic) {
  return r.Bytes(&nic->name, kMaxStringBytes) && r.Bytes(&nic->address, kMaxStringBytes) &&
         r.I32(&nic->numa_node) && r.U64(&nic->link_bits_per_sec) && r.U32(&nic->mtu);
}

// A status as EncodeError writes it; false if malformed (or OK).
bool ReadStatus(absl::string_view payload, absl::Status* status) {
  Reader r(payload);
  uint8_t code;
  std::string message;
  if (!r.U8(&code) || !r.Bytes(&message, kMaxStringBytes) || !r.AtEnd() || code == 0 ||
      code > static_cast<uint8_t>(absl::StatusCode::kUnauthenticated)) {
    return false;
  }
  *status = absl::Status(static_cast<absl::StatusCode>(code), message);
  return true;
}

}  // namespace

std::string EncodeFrame(MessageType type, absl::string_view payload) {
  std::string out;
  out.reserve(kFrameHeaderBytes + payload.size());
  Writer w(&out);
  w.U16(kMagic);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(type));
  w.U32(static_cast<uint32_t>(payload.size()));
  out.append(payload.data(), payload.size());
  return out;
}

absl::StatusOr<FrameHeader> ParseFrameHeader(absl::string_view header, uint32_t max_payload_bytes) {
  Reader r(header);
  uint16_t magic;
  uint8_t version, type;
  uint32_t length;
  if (!r.U16(&magic) || !r.U8(&version) || !r.U8(&type) || !r.U32(&length)) {
    return absl::DataLossError("truncated frame header");
  }
  if (magic != kMagic) {
    return absl::DataLossError(
        absl::StrCat("not a kvferry handshake frame (magic 0x", absl::Hex(magic), ")"));
  }
  if (version != kVersion) {
    return absl::UnimplementedError(absl::StrCat("peer speaks handshake version ", version,
                                                 "; this build speaks version ", kVersion));
  }
  if (type < static_cast<uint8_t>(MessageType::kDescribe) || type > kLastMessageType) {
    return absl::DataLossError(absl::StrCat("unknown message type ", type));
  }
  if (length > max_payload_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("frame of ", length, " bytes exceeds the limit of ", max_payload_bytes));
  }
  return FrameHeader{static_cast<MessageType>(type), length};
}

std::string Encode(const EngineDescriptor& d) {
  std::string out;
  Writer w(&out);
  w.U64(d.engine_id);
  w.Bytes(d.transport_kind);
  w.U32(static_cast<uint32_t>(d.nics.size()));
  for (const auto& nic : d.nics) WriteNic(w, nic);
  w.U32(static_cast<uint32_t>(d.regions.size()));
  for (const auto& region : d.regions) {
    w.U64(region.addr);
    w.U64(region.length);
    w.U8(static_cast<uint8_t>(region.access));
    w.U32(static_cast<uint32_t>(region.keys.size()));
    for (uint64_t key : region.keys) w.U64(key);
  }
  return out;
}

absl::StatusOr<EngineDescriptor> DecodeDescriptor(absl::string_view payload) {
  Reader r(payload);
  EngineDescriptor d;
  uint32_t nics = 0, regions = 0;
  if (!r.U64(&d.engine_id) || !r.Bytes(&d.transport_kind, kMaxStringBytes)) {
    return Malformed("descriptor");
  }
  if (!r.U32(&nics)) return Malformed("descriptor");
  if (nics == 0 || nics > kMaxNics) {
    return absl::ResourceExhaustedError(
        absl::StrCat("descriptor lists ", nics, " NICs; 1 to ", kMaxNics, " are allowed"));
  }
  d.nics.resize(nics);
  for (auto& nic : d.nics) {
    if (!ReadNic(r, &nic)) return Malformed("descriptor");
  }
  if (!r.U32(&regions)) return Malformed("descriptor");
  if (regions > kMaxRegions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("descriptor lists ", regions, " regions; the limit is ", kMaxRegions));
  }
  // Each region takes at least 21 bytes: reject absurd counts before
  // allocating for them.
  if (regions > r.remaining() / 21) return Malformed("descriptor");
  d.regions.resize(regions);
  for (auto& region : d.regions) {
    uint8_t access;
    uint32_t keys;
    if (!r.U64(&region.addr) || !r.U64(&region.length) || !r.U8(&access) || !r.U32(&keys)) {
      return Malformed("descriptor");
    }
    if (access > 3 || keys != nics || region.length == 0 ||
        region.addr + region.length < region.addr) {
      return Malformed("descriptor region");
    }
    region.access = static_cast<transport::Access>(access);
    region.keys.resize(keys);
    for (auto& key : region.keys) {
      if (!r.U64(&key)) return Malformed("descriptor");
    }
  }
  if (!r.AtEnd()) return Malformed("descriptor");
  return d;
}

std::string EncodeDescriptorV2(const EngineDescriptor& d) {
  std::string out;
  Writer w(&out);
  w.U16(d.protocol_version);
  w.U64(d.capabilities.value_or(0));
  out += Encode(d);
  return out;
}

absl::StatusOr<EngineDescriptor> DecodeDescriptorV2(absl::string_view payload) {
  Reader r(payload);
  uint16_t version;
  uint64_t capabilities;
  if (!r.U16(&version) || !r.U64(&capabilities)) return Malformed("descriptor");
  if (version < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor-v2 states protocol version ", version, "; 2 or later expected"));
  }
  ASSIGN_OR_RETURN(EngineDescriptor d, DecodeDescriptor(payload.substr(10)));
  d.protocol_version = version;
  d.capabilities = capabilities;
  return d;
}

std::string Encode(const ConnectRequest& c) {
  std::string out;
  Writer w(&out);
  w.U64(c.engine_id);
  w.U32(c.requester_nic);
  WriteNic(w, c.requester_nic_info);
  w.U32(c.target_nic);
  w.Bytes(c.params);
  if (c.epoch != 0) w.U64(c.epoch);
  return out;
}

absl::StatusOr<ConnectRequest> DecodeConnectRequest(absl::string_view payload) {
  Reader r(payload);
  ConnectRequest c;
  if (!r.U64(&c.engine_id) || !r.U32(&c.requester_nic) || !ReadNic(r, &c.requester_nic_info) ||
      !r.U32(&c.target_nic) || !r.Bytes(&c.params, kMaxStringBytes) ||
      (!r.AtEnd() && (!r.U64(&c.epoch) || c.epoch == 0 || !r.AtEnd()))) {
    return Malformed("connect");
  }
  return c;
}

std::string Encode(const ConnectReply& c) {
  std::string out;
  Writer w(&out);
  w.Bytes(c.params);
  return out;
}

absl::StatusOr<ConnectReply> DecodeConnectReply(absl::string_view payload) {
  Reader r(payload);
  ConnectReply c;
  if (!r.Bytes(&c.params, kMaxStringBytes) || !r.AtEnd()) {
    return Malformed("connect-reply");
  }
  return c;
}

std::string Encode(const ConnectLinksRequest& c) {
  std::string out;
  Writer w(&out);
  w.U32(static_cast<uint32_t>(c.links.size()));
  for (const ConnectRequest& link : c.links) w.Bytes(Encode(link));
  return out;
}

absl::StatusOr<ConnectLinksRequest> DecodeConnectLinksRequest(absl::string_view payload) {
  Reader r(payload);
  uint32_t count = 0;
  if (!r.U32(&count)) return Malformed("connect-links");
  if (count == 0 || count > kMaxLinksPerConnect) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connect-links asks for ", count, " links; 1 to ", kMaxLinksPerConnect, " are allowed"));
  }
  ConnectLinksRequest c;
  c.links.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    std::string one;
    if (!r.Bytes(&one, kMaxConnectRequestBytes)) return Malformed("connect-links");
    absl::StatusOr<ConnectRequest> link = DecodeConnectRequest(one);
    if (!link.ok()) return link.status();
    c.links.push_back(std::move(*link));
  }
  if (!r.AtEnd()) return Malformed("connect-links");
  return c;
}

std::string Encode(const ConnectLinksReply& c) {
  std::string out;
  Writer w(&out);
  w.U32(static_cast<uint32_t>(c.links.size()));
  for (const absl::StatusOr<std::string>& link : c.links) {
    w.U8(link.ok() ? 1 : 0);
    w.Bytes(link.ok() ? *link : EncodeError(link.status()));
  }
  return out;
}

absl::StatusOr<ConnectLinksReply> DecodeConnectLinksReply(absl::string_view payload) {
  Reader r(payload);
  uint32_t count = 0;
  if (!r.U32(&count) || count == 0 || count > kMaxLinksPerConnect) {
    return Malformed("connect-links-reply");
  }
  ConnectLinksReply c;
  c.links.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t ok = 0;
    std::string bytes;
    if (!r.U8(&ok) || ok > 1 || !r.Bytes(&bytes, kMaxStringBytes + 8)) {
      return Malformed("connect-links-reply");
    }
    if (ok == 1) {
      if (bytes.size() > kMaxStringBytes) return Malformed("connect-links-reply");
      c.links.emplace_back(std::move(bytes));
      continue;
    }
    absl::Status refused;
    if (!ReadStatus(bytes, &refused)) return Malformed("connect-links-reply");
    c.links.emplace_back(std::move(refused));
  }
  if (!r.AtEnd()) return Malformed("connect-links-reply");
  return c;
}

std::string Encode(const CloseLinksRequest& c) {
  std::string out;
  Writer w(&out);
  w.U64(c.engine_id);
  w.U32(static_cast<uint32_t>(c.links.size()));
  for (const std::string& link : c.links) w.Bytes(link);
  return out;
}

absl::StatusOr<CloseLinksRequest> DecodeCloseLinksRequest(absl::string_view payload) {
  Reader r(payload);
  CloseLinksRequest c;
  uint32_t count = 0;
  if (!r.U64(&c.engine_id) || !r.U32(&count)) return Malformed("close-links");
  if (count == 0 || count > kMaxLinksPerConnect) {
    return absl::InvalidArgumentError(absl::StrCat("close-links names ", count, " links; 1 to ",
                                                   kMaxLinksPerConnect, " are allowed"));
  }
  c.links.resize(count);
  for (std::string& link : c.links) {
    if (!r.Bytes(&link, kMaxStringBytes)) return Malformed("close-links");
  }
  if (!r.AtEnd()) return Malformed("close-links");
  return c;
}

std::string Encode(const Notify& n) {
  std::string out;
  Writer w(&out);
  w.U64(n.engine_id);
  w.Bytes(n.payload);
  w.U64(n.target_engine_id);
  if (n.epoch != 0) w.U64(n.epoch);
  return out;
}

absl::StatusOr<Notify> DecodeNotify(absl::string_view payload) {
  Reader r(payload);
  Notify n;
  if (!r.U64(&n.engine_id) || !r.Bytes(&n.payload, kMaxNotifyBytes) ||
      !r.U64(&n.target_engine_id) ||
      (!r.AtEnd() && (!r.U64(&n.epoch) || n.epoch == 0 || !r.AtEnd()))) {
    return Malformed("notify");
  }
  return n;
}

std::string Encode(const Probe& p) {
  std::string out;
  Writer w(&out);
  w.U64(p.engine_id);
  w.U64(p.nonce);
  return out;
}

absl::StatusOr<Probe> DecodeProbe(absl::string_view payload) {
  Reader r(payload);
  Probe p;
  if (!r.U64(&p.engine_id) || !r.U64(&p.nonce) || !r.AtEnd()) {
    return Malformed("probe");
  }
  return p;
}

std::string Encode(const Confirm& c) {
  std::string out;
  Writer w(&out);
  w.U64(c.engine_id);
  w.U64(c.digest);
  return out;
}

absl::StatusOr<Confirm> DecodeConfirm(absl::string_view payload) {
  Reader r(payload);
  Confirm c;
  if (!r.U64(&c.engine_id) || !r.U64(&c.digest) || !r.AtEnd()) return Malformed("confirm");
  return c;
}

std::string Encode(const ConfirmReply& c) {
  std::string out;
  Writer w(&out);
  w.U64(c.engine_id);
  w.U8(c.sent ? 1 : 0);
  return out;
}

absl::StatusOr<ConfirmReply> DecodeConfirmReply(absl::string_view payload) {
  Reader r(payload);
  ConfirmReply c;
  uint8_t sent = 0;
  if (!r.U64(&c.engine_id) || !r.U8(&sent) || sent > 1 || !r.AtEnd()) {
    return Malformed("confirm-reply");
  }
  c.sent = sent == 1;
  return c;
}

std::string Encode(const MetadataRequest& m) {
  std::string out;
  Writer w(&out);
  w.Bytes(m.key);
  return out;
}

absl::StatusOr<MetadataRequest> DecodeMetadataRequest(absl::string_view payload) {
  Reader r(payload);
  MetadataRequest m;
  if (!r.Bytes(&m.key, kMaxStringBytes) || !r.AtEnd()) return Malformed("get-metadata");
  return m;
}

std::string Encode(const Metadata& m) {
  std::string out;
  Writer w(&out);
  w.Bytes(m.key);
  w.Bytes(m.value);
  w.U64(m.engine_id);
  return out;
}

absl::StatusOr<Metadata> DecodeMetadata(absl::string_view payload) {
  Reader r(payload);
  Metadata m;
  if (!r.Bytes(&m.key, kMaxStringBytes) || !r.Bytes(&m.value, kMaxNotifyBytes) ||
      !r.U64(&m.engine_id) || !r.AtEnd()) {
    return Malformed("metadata");
  }
  return m;
}

std::string EncodeError(const absl::Status& status) {
  std::string out;
  Writer w(&out);
  w.U8(static_cast<uint8_t>(status.ok() ? absl::StatusCode::kUnknown : status.code()));
  w.Bytes(status.message().substr(0, kMaxStringBytes));
  return out;
}

namespace {
constexpr char kAnsweredUrl[] = "kvferry.handshake/peer-answered";
}  // namespace

absl::Status DecodeError(absl::string_view payload) {
  absl::Status status;
  if (!ReadStatus(payload, &status)) status = Malformed("error");
  status.SetPayload(kAnsweredUrl, absl::Cord("1"));
  return status;
}

bool PeerAnswered(const absl::Status& status) {
  return status.GetPayload(kAnsweredUrl).has_value();
}

}  // namespace handshake
}  // namespace kvferry
