#include "engine/kv_words.h"

#include <atomic>
#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/crc32c.h"

namespace kvferry {
namespace kv_internal {
namespace {

void PutU32(std::string* out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  out->append(b, 4);
}

}  // namespace

std::string KvMessage(absl::string_view kind, absl::string_view id, uint64_t token,
                      absl::string_view body) {
  const std::string sep(1, kSep);
  return absl::StrCat("kv2", sep, kind, sep, id, sep, absl::Hex(token, absl::kZeroPad16), sep,
                      body);
}

std::optional<Word> ParseWord(absl::string_view message) {
  std::vector<absl::string_view> p = absl::StrSplit(message, absl::MaxSplits(kSep, 3));
  if (p.size() != 4 || (p[0] != "kv1" && p[0] != "kv2")) return std::nullopt;
  Word w{p[1], p[2], p[3]};
  if (p[0] == "kv2") {
    if (w.body.size() < 17 || w.body[16] != kSep ||
        !absl::SimpleHexAtoi(w.body.substr(0, 16), &w.token)) {
      return std::nullopt;
    }
    w.body.remove_prefix(17);
  }
  if (w.kind != "done" && w.kind != "donc" && w.kind != "fail" && w.kind != "abrt") {
    return std::nullopt;
  }
  return w;
}

uint64_t NewToken() {
  static std::atomic<uint64_t> next{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  const uint64_t t = next.fetch_add(0x9e3779b97f4a7c15ull);
  return t == 0 ? 1 : t;
}

uint32_t PageCrc(const KvPool& pool, uint32_t page) {
  const KvLayout& l = pool.layout();
  uint32_t crc = 0;
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    crc = Crc32c(pool.buffer(b) + uint64_t{page} * l.page_bytes(), l.page_bytes(), crc);
  }
  return crc;
}

bool GetU32(absl::string_view* in, uint32_t* v) {
  if (in->size() < 4) return false;
  std::memcpy(v, in->data(), 4);
  in->remove_prefix(4);
  return true;
}

std::string ChecksummedBody(const KvPool& pool, const std::vector<PageRun>& runs,
                            absl::string_view aux) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(runs.size()));
  for (const PageRun& r : runs) {
    PutU32(&out, r.dst);
    PutU32(&out, r.count);
  }
  for (const PageRun& r : runs) {
    for (uint32_t i = 0; i < r.count; ++i) PutU32(&out, PageCrc(pool, r.src + i));
  }
  out.append(aux.data(), aux.size());
  return out;
}

absl::Status CheckRequestId(const std::string& id) {
  if (id.empty() || id.find(kSep) != std::string::npos) {
    return absl::InvalidArgumentError("request ids must be non-empty and contain no NUL");
  }
  return absl::OkStatus();
}

}  // namespace kv_internal
}  // namespace kvferry
