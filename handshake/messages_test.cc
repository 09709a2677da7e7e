#include "handshake/messages.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "handshake/wire.h"
#include "sim/prng.h"
#include "sim/seed.h"

namespace kvferry {
namespace handshake {
namespace {

EngineDescriptor SampleDescriptor() {
  EngineDescriptor d;
  d.engine_id = 0x1122334455667788ULL;
  d.transport_kind = "tcp";
  d.nics.push_back({"eth0", "10.0.0.1:15001", 0, 100'000'000'000, 1500});
  d.nics.push_back({"eth1", "10.0.1.1:15002", 1, 0, 9000});
  d.regions.push_back({0x7f0000001000, 4096, transport::Access::kRemoteWrite, {1, 2}});
  d.regions.push_back(
      {0x7f0000100000, 1 << 20, transport::Access::kRemoteReadWrite, {0xdeadbeefcafe, 3}});
  return d;
}

TEST(Frame, RoundTripAndHeaderErrors) {
  std::string frame = EncodeFrame(MessageType::kNotify, "abc");
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 3);
  auto h = ParseFrameHeader(frame, 1024);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->type, MessageType::kNotify);
  EXPECT_EQ(h->payload_bytes, 3u);

  EXPECT_EQ(ParseFrameHeader(frame.substr(0, 7), 1024).status().code(),
            absl::StatusCode::kDataLoss);
  std::string bad_magic = frame;
  bad_magic[0] = 'X';
  EXPECT_EQ(ParseFrameHeader(bad_magic, 1024).status().code(), absl::StatusCode::kDataLoss);
  std::string v2 = frame;
  v2[2] = 2;
  auto version = ParseFrameHeader(v2, 1024);
  EXPECT_EQ(version.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(version.status().message().find("version 2"), std::string::npos);
  std::string bad_type = frame;
  bad_type[3] = 42;
  EXPECT_EQ(ParseFrameHeader(bad_type, 1024).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseFrameHeader(frame, 2).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(Descriptor, RoundTrip) {
  EngineDescriptor d = SampleDescriptor();
  auto back = DecodeDescriptor(Encode(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->engine_id, d.engine_id);
  EXPECT_EQ(back->transport_kind, "tcp");
  ASSERT_EQ(back->nics.size(), 2u);
  EXPECT_EQ(back->nics[1].address, "10.0.1.1:15002");
  EXPECT_EQ(back->nics[1].numa_node, 1);
  EXPECT_EQ(back->nics[1].mtu, 9000u);
  ASSERT_EQ(back->regions.size(), 2u);
  EXPECT_EQ(back->regions[1].addr, d.regions[1].addr);
  EXPECT_EQ(back->regions[1].length, 1u << 20);
  EXPECT_EQ(back->regions[1].access, transport::Access::kRemoteReadWrite);
  EXPECT_EQ(back->regions[1].keys, d.regions[1].keys);
}

// kDescriptorV2: the version and capabilities ahead of the descriptor.
// A version 1 reader of kDescriptor never sees them (the v1 encoding is
// unchanged and refuses trailing bytes); a V2 payload stating version 1,
// or cut anywhere, is refused.
TEST(Descriptor, VersionTwoCarriesVersionAndCapabilities) {
  EngineDescriptor d = SampleDescriptor();
  d.protocol_version = 2;
  d.capabilities = kCapabilities | (uint64_t{1} << 40);  // a bit from a later version, kept
  auto back = DecodeDescriptorV2(EncodeDescriptorV2(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->protocol_version, 2);
  EXPECT_EQ(back->capabilities, d.capabilities);
  EXPECT_EQ(back->Speaks(kCapConnectLinksHere), std::optional<bool>(true));
  EXPECT_EQ(back->regions[1].keys, d.regions[1].keys);
  EXPECT_EQ(Encode(d), Encode(SampleDescriptor()));  // v1 bytes: no version, no capabilities
  auto v1 = DecodeDescriptor(Encode(d));
  ASSERT_TRUE(v1.ok());
  EXPECT_FALSE(v1->capabilities.has_value());
  EXPECT_EQ(DecodeDescriptor(EncodeDescriptorV2(d)).status().code(), absl::StatusCode::kDataLoss);
  d.protocol_version = 1;
  EXPECT_EQ(DecodeDescriptorV2(EncodeDescriptorV2(d)).status().code(),
            absl::StatusCode::kInvalidArgument);
  d.protocol_version = 2;
  const std::string v2 = EncodeDescriptorV2(d);
  for (size_t len = 0; len < v2.size(); ++len) {
    EXPECT_FALSE(DecodeDescriptorV2(absl::string_view(v2.data(), len)).ok()) << len;
  }
}

TEST(Descriptor, RejectsInconsistentOrExcessiveContent) {
  EngineDescriptor d = SampleDescriptor();
  d.regions[0].keys.pop_back();  // keys must match NICs
  EXPECT_EQ(DecodeDescriptor(Encode(d)).status().code(), absl::StatusCode::kDataLoss);
  d = SampleDescriptor();
  d.regions[0].length = 0;
  EXPECT_EQ(DecodeDescriptor(Encode(d)).status().code(), absl::StatusCode::kDataLoss);
  d = SampleDescriptor();
  d.regions[0].addr = ~uint64_t{0} - 10;  // wraps
  EXPECT_EQ(DecodeDescriptor(Encode(d)).status().code(), absl::StatusCode::kDataLoss);
  d = SampleDescriptor();
  d.nics.clear();
  d.regions.clear();
  EXPECT_EQ(DecodeDescriptor(Encode(d)).status().code(), absl::StatusCode::kResourceExhausted);
  // A region count above the limit is refused before any allocation.
  std::string payload;
  Writer w(&payload);
  w.U64(1);
  w.Bytes("tcp");
  w.U32(1);
  w.Bytes("eth0");
  w.Bytes("a");
  w.I32(-1);
  w.U64(0);
  w.U32(0);
  w.U32(kMaxRegions + 1);
  auto many = DecodeDescriptor(payload);
  EXPECT_EQ(many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(many.status().message().find("regions"), std::string::npos);
  // Trailing garbage is malformed too.
  EXPECT_EQ(DecodeDescriptor(Encode(SampleDescriptor()) + "x").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(Messages, OthersRoundTrip) {
  ConnectRequest c{7, 1, {"eth1", "addr", -1, 0, 0}, 2, std::string("\0\1\2", 3)};
  auto c2 = DecodeConnectRequest(Encode(c));
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->engine_id, 7u);
  EXPECT_EQ(c2->requester_nic, 1u);
  EXPECT_EQ(c2->requester_nic_info.name, "eth1");
  EXPECT_EQ(c2->target_nic, 2u);
  EXPECT_EQ(c2->params, c.params);
  auto r = DecodeConnectReply(Encode(ConnectReply{"xyz"}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->params, "xyz");
  auto n = DecodeNotify(Encode(Notify{9, "done:42"}));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->engine_id, 9u);
  EXPECT_EQ(n->payload, "done:42");
  auto p = DecodeProbe(Encode(Probe{5, 6}));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->nonce, 6u);
  auto mr = DecodeMetadataRequest(Encode(MetadataRequest{"kv_pool"}));
  ASSERT_TRUE(mr.ok());
  EXPECT_EQ(mr->key, "kv_pool");
  auto md = DecodeMetadata(Encode(Metadata{"kv_pool", std::string("\0\1", 2)}));
  ASSERT_TRUE(md.ok());
  EXPECT_EQ(md->value, std::string("\0\1", 2));
  EXPECT_FALSE(DecodeMetadata(Encode(Metadata{"k", "v"}).substr(0, 9)).ok());
  absl::Status e = DecodeError(EncodeError(absl::NotFoundError("no region")));
  EXPECT_EQ(e.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e.message(), "no region");
}

// An epoch travels only when it is not 0: a frame without one reads as it
// always did, and one with a zero epoch written out is malformed.
TEST(Messages, EpochsTravelWhenNotZero) {
  ConnectRequest c{5, 1, {"lo", "127.0.0.1:9", 0, 0, 0}, 0, "params"};
  const std::string plain = Encode(c);
  c.epoch = 3;
  const std::string with = Encode(c);
  EXPECT_EQ(with.size(), plain.size() + 8);
  EXPECT_EQ(DecodeConnectRequest(plain)->epoch, 0u);
  EXPECT_EQ(DecodeConnectRequest(with)->epoch, 3u);
  EXPECT_FALSE(DecodeConnectRequest(plain + std::string(8, '\0')).ok());
  EXPECT_FALSE(DecodeConnectRequest(with + "x").ok());
  Notify n{9, "done", 4};
  EXPECT_EQ(DecodeNotify(Encode(n))->epoch, 0u);
  n.epoch = 2;
  auto back = DecodeNotify(Encode(n));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->epoch, 2u);
  EXPECT_EQ(back->target_engine_id, 4u);
  EXPECT_FALSE(DecodeNotify(Encode(Notify{9, "done", 4}) + std::string(8, '\0')).ok());
}

// A fence refusal names its epoch in the message, which survives an error
// frame; nothing else is read as one.
TEST(Messages, FencedEpochIsReadFromTheRefusal) {
  const absl::Status refused = FencedError("engine 0x1 was declared failed", 7);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FencedEpoch(refused), 7u);
  EXPECT_EQ(FencedEpoch(DecodeError(EncodeError(refused))), 7u);
  EXPECT_EQ(FencedEpoch(absl::FailedPreconditionError("no epoch here")), std::nullopt);
  EXPECT_EQ(FencedEpoch(absl::UnavailableError("x [fence epoch 7]")), std::nullopt);
  EXPECT_EQ(FencedEpoch(absl::FailedPreconditionError("x [fence epoch ]")), std::nullopt);
  EXPECT_EQ(FencedEpoch(absl::FailedPreconditionError("x [fence epoch 18446744073709551615]")),
            std::nullopt);
}

TEST(Messages, ConnectLinksRoundTripAndBounds) {
  ConnectLinksRequest batch;
  for (uint32_t i = 0; i < 3; ++i) {
    batch.links.push_back(ConnectRequest{
        7, i, {"eth1", "addr", -1, 0, 0}, i + 1, std::string("p\0", 2) + char('a' + i)});
  }
  auto b = DecodeConnectLinksRequest(Encode(batch));
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->links.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(b->links[i].requester_nic, i);
    EXPECT_EQ(b->links[i].target_nic, i + 1);
    EXPECT_EQ(b->links[i].params, batch.links[i].params);
  }
  ConnectLinksReply reply;
  reply.links.emplace_back(std::string("ok-params"));
  reply.links.emplace_back(absl::DeadlineExceededError("no hello"));
  auto r = DecodeConnectLinksReply(Encode(reply));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->links.size(), 2u);
  ASSERT_TRUE(r->links[0].ok());
  EXPECT_EQ(*r->links[0], "ok-params");
  EXPECT_EQ(r->links[1].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r->links[1].status().message(), "no hello");
  // No links, or more than the cap, is refused by count before anything is
  // read or allocated.
  EXPECT_EQ(DecodeConnectLinksRequest(Encode(ConnectLinksRequest{})).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::string huge;
  huge.append("\xff\xff\xff\x7f", 4);
  auto too_many = DecodeConnectLinksRequest(huge);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("1 to 64"), std::string::npos);
  EXPECT_FALSE(DecodeConnectLinksReply(huge).ok());
  // A reply element that is neither parameters nor a status is malformed.
  std::string bad = Encode(reply);
  bad[4] = 2;
  EXPECT_EQ(DecodeConnectLinksReply(bad).status().code(), absl::StatusCode::kDataLoss);
  const std::string whole_batch = Encode(batch);
  for (size_t len = 0; len < whole_batch.size(); ++len) {
    EXPECT_FALSE(DecodeConnectLinksRequest(whole_batch.substr(0, len)).ok()) << "cut at " << len;
  }
  const std::string whole_reply = Encode(reply);
  for (size_t len = 0; len < whole_reply.size(); ++len) {
    EXPECT_FALSE(DecodeConnectLinksReply(whole_reply.substr(0, len)).ok()) << "cut at " << len;
  }
}

TEST(Messages, CloseLinksRoundTripAndBounds) {
  CloseLinksRequest c{0x1234, {"qpn=17", std::string("t\0k", 3), ""}};
  auto d = DecodeCloseLinksRequest(Encode(c));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->engine_id, 0x1234u);
  EXPECT_EQ(d->links, c.links);
  EXPECT_EQ(DecodeCloseLinksRequest(Encode(CloseLinksRequest{1, {}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  CloseLinksRequest many{1, std::vector<std::string>(65, "x")};
  auto too_many = DecodeCloseLinksRequest(Encode(many));
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("1 to 64"), std::string::npos);
  const std::string whole = Encode(c);
  for (size_t len = 0; len < whole.size(); ++len) {
    EXPECT_FALSE(DecodeCloseLinksRequest(whole.substr(0, len)).ok()) << "cut at " << len;
  }
  EXPECT_STREQ(MessageTypeName(MessageType::kCloseLinks), "close-links");
  EXPECT_STREQ(MessageTypeName(MessageType::kCloseLinksReply), "close-links-reply");
}

TEST(Messages, EveryTruncationIsAnError) {
  const std::vector<std::string> payloads = {
      Encode(SampleDescriptor()),
      Encode(ConnectRequest{7, 1, {"eth1", "addr", -1, 0, 0}, 2, "params"}),
      Encode(Notify{9, "payload"}), Encode(Probe{1, 2}), EncodeError(absl::InternalError("x"))};
  for (size_t which = 0; which < payloads.size(); ++which) {
    for (size_t len = 0; len < payloads[which].size(); ++len) {
      absl::string_view cut(payloads[which].data(), len);
      absl::Status s;
      switch (which) {
        case 0:
          s = DecodeDescriptor(cut).status();
          break;
        case 1:
          s = DecodeConnectRequest(cut).status();
          break;
        case 2:
          s = DecodeNotify(cut).status();
          break;
        case 3:
          s = DecodeProbe(cut).status();
          break;
        case 4:
          s = DecodeError(cut);
          EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
          continue;
      }
      EXPECT_FALSE(s.ok()) << "message " << which << " cut at " << len;
    }
  }
}

// A seeded corpus of mutated frames: decoding never crashes (ASan/UBSan
// watch), and every outcome is either a value or a clear error.
TEST(Messages, MutationCorpusNeverCrashes) {
  const uint64_t seed = sim::TestSeed(20261129);
  SCOPED_TRACE(sim::ReplayCommand(seed));
  sim::Prng prng(seed);
  const std::vector<std::string> base = {
      Encode(SampleDescriptor()),
      Encode(ConnectRequest{7, 1, {"eth1", "addr", -1, 0, 0}, 2, "params"}),
      Encode(Notify{9, "payload"}), Encode(Probe{1, 2}), EncodeError(absl::InternalError("x"))};
  int errors = 0, values = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string m = base[prng.Uniform(base.size())];
    const int edits = 1 + prng.Uniform(4);
    for (int e = 0; e < edits; ++e) {
      switch (prng.Uniform(4)) {
        case 0:  // flip a bit
          if (!m.empty()) m[prng.Uniform(m.size())] ^= char(1 << prng.Uniform(8));
          break;
        case 1:  // set a byte to an extreme
          if (!m.empty()) m[prng.Uniform(m.size())] = prng.Chance({1, 2}) ? '\xff' : '\0';
          break;
        case 2:  // truncate
          m.resize(prng.Uniform(m.size() + 1));
          break;
        case 3:  // insert random bytes
          m.insert(prng.Uniform(m.size() + 1),
                   std::string(1 + prng.Uniform(8), char(prng.Next64())));
          break;
      }
    }
    std::string frame = EncodeFrame(MessageType(1 + prng.Uniform(kLastMessageType)), m);
    if (prng.Chance({1, 4})) frame[prng.Uniform(kFrameHeaderBytes)] ^= 0x5a;
    auto header = ParseFrameHeader(frame, kDefaultMaxFrameBytes);
    if (!header.ok()) {
      ++errors;
      continue;
    }
    absl::string_view payload(frame.data() + kFrameHeaderBytes, frame.size() - kFrameHeaderBytes);
    absl::Status s;
    switch (header->type) {
      case MessageType::kDescriptor:
        s = DecodeDescriptor(payload).status();
        break;
      case MessageType::kDescriptorV2:
        s = DecodeDescriptorV2(payload).status();
        break;
      case MessageType::kConnect:
        s = DecodeConnectRequest(payload).status();
        break;
      case MessageType::kConnectReply:
        s = DecodeConnectReply(payload).status();
        break;
      case MessageType::kConnectLinks:
        s = DecodeConnectLinksRequest(payload).status();
        break;
      case MessageType::kConnectLinksReply:
        s = DecodeConnectLinksReply(payload).status();
        break;
      case MessageType::kNotify:
        s = DecodeNotify(payload).status();
        break;
      case MessageType::kProbe:
      case MessageType::kProbeReply:
        s = DecodeProbe(payload).status();
        break;
      case MessageType::kError:
        s = DecodeError(payload);
        break;
      case MessageType::kGetMetadata:
        s = DecodeMetadataRequest(payload).status();
        break;
      case MessageType::kMetadata:
        s = DecodeMetadata(payload).status();
        break;
      default:
        s = absl::OkStatus();
        break;
    }
    if (s.ok() || header->type == MessageType::kError) {
      ++values;
    } else {
      ++errors;
      EXPECT_FALSE(s.message().empty());
    }
  }
  EXPECT_GT(errors, 1000);  // most mutations are caught
  EXPECT_GT(values, 0);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry
