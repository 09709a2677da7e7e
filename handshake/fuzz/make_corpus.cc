// Writes the seed corpus: valid frames of every type and valid descriptors
// (TCP-, verbs- and sim-like). Regenerate with
//   ./bazelw run //handshake/fuzz:make_corpus -- $PWD/handshake/fuzz/corpus
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "handshake/messages.h"

namespace kvferry {
namespace handshake {
namespace {

EngineDescriptor Descriptor(int nics, int regions, const std::string& kind) {
  EngineDescriptor d;
  d.engine_id = 0x1234567890abcdefull + nics;
  d.transport_kind = kind;
  for (int i = 0; i < nics; ++i) {
    transport::NicInfo n;
    n.name = absl::StrCat("mlx5_", i, ":1");
    n.address = absl::StrCat(kind, ":0000:0000:0000:0000:0000:ffff:0a00:0", i, "01/0");
    n.numa_node = i % 2;
    n.link_bits_per_sec = 400'000'000'000ull;
    n.mtu = 4096;
    d.nics.push_back(n);
  }
  for (int r = 0; r < regions; ++r) {
    RegionDescriptor rd;
    rd.addr = 0x7f0000000000ull + (static_cast<uint64_t>(r) << 30);
    rd.length = uint64_t{1} << (12 + r);
    rd.access = static_cast<transport::Access>(r % 4);
    for (int i = 0; i < nics; ++i) rd.keys.push_back(0x1000u + r * 16 + i);
    d.regions.push_back(rd);
  }
  return d;
}

bool Write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
  return static_cast<bool>(f);
}

}  // namespace
}  // namespace handshake
}  // namespace kvferry

int main(int argc, char** argv) {
  using namespace kvferry::handshake;
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: make_corpus OUT_DIR (writes OUT_DIR/frame and OUT_DIR/descriptor)\n");
    return 2;
  }
  const std::string out = argv[1];
  std::vector<std::pair<std::string, std::string>> frames = {
      {"describe", EncodeFrame(MessageType::kDescribe, "")},
      {"descriptor", EncodeFrame(MessageType::kDescriptor, Encode(Descriptor(2, 3, "verbs")))},
      {"connect", EncodeFrame(MessageType::kConnect,
                              Encode(ConnectRequest{7, 1, Descriptor(1, 0, "tcp").nics[0], 0,
                                                    "qpn=17 psn=5 gid=..."}))},
      {"connect_reply", EncodeFrame(MessageType::kConnectReply, Encode(ConnectReply{"params"}))},
      {"connect_links",
       EncodeFrame(MessageType::kConnectLinks,
                   Encode(ConnectLinksRequest{
                       {ConnectRequest{7, 0, Descriptor(1, 0, "tcp").nics[0], 0, "a"},
                        ConnectRequest{7, 0, Descriptor(1, 0, "tcp").nics[0], 0, "b"}}}))},
      {"connect_links_reply",
       EncodeFrame(MessageType::kConnectLinksReply,
                   Encode(ConnectLinksReply{
                       {std::string("params"), absl::DeadlineExceededError("no hello")}}))},
      {"close_links", EncodeFrame(MessageType::kCloseLinks,
                                  Encode(CloseLinksRequest{7, {"qpn=17 psn=5", "token=9"}}))},
      {"notify", EncodeFrame(MessageType::kNotify, Encode(Notify{9, "request 42 done"}))},
      {"probe", EncodeFrame(MessageType::kProbe, Encode(Probe{9, 77}))},
      {"get_metadata", EncodeFrame(MessageType::kGetMetadata, Encode(MetadataRequest{"kv"}))},
      {"metadata", EncodeFrame(MessageType::kMetadata, Encode(Metadata{"kv", "layers=32"}))},
      {"error", EncodeFrame(MessageType::kError, EncodeError(absl::NotFoundError("no such key")))},
      {"challenge", EncodeFrame(MessageType::kChallenge, "")},
  };
  bool ok = true;
  for (const auto& [name, bytes] : frames) ok &= Write(out + "/frame/" + name, bytes);
  ok &= Write(out + "/descriptor/empty", Encode(Descriptor(0, 0, "tcp")));
  ok &= Write(out + "/descriptor/tcp", Encode(Descriptor(1, 2, "tcp")));
  ok &= Write(out + "/descriptor/verbs8", Encode(Descriptor(8, 6, "verbs")));
  ok &= Write(out + "/descriptor/sim", Encode(Descriptor(2, 1, "sim")));
  if (!ok) {
    std::fprintf(stderr, "make_corpus: cannot write under %s (do frame/ and descriptor/ exist?)\n",
                 out.c_str());
    return 1;
  }
  return 0;
}
