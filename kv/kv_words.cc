#include "kv/kv_words.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/crc32c.h"
#include "base/status_macros.h"
#include "cuda/driver.h"
#include "net/socket.h"

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
  if (w.kind != "done" && w.kind != "donc" && w.kind != "fail" && w.kind != "abrt" &&
      w.kind != "begn") {
    return std::nullopt;
  }
  return w;
}

uint64_t NewToken() {
  static std::atomic<uint64_t> next{net::RandomU64()};
  const uint64_t t = next.fetch_add(0x9e3779b97f4a7c15ull);
  return t == 0 ? 1 : t;
}

absl::StatusOr<std::vector<uint32_t>> PageCrcs(const KvPool& pool, const std::vector<PageRun>& runs,
                                               bool dst) {
  const KvLayout& l = pool.layout();
  const uint64_t pb = l.page_bytes();
  std::vector<uint32_t> crcs;
  for (const PageRun& r : runs) crcs.resize(crcs.size() + r.count, 0);
  // Buffer by buffer, each run's pages in one read: page i's CRC goes on
  // where the buffer before left it.
  for (uint32_t b = 0; b < l.buffer_count(); ++b) {
    size_t first = 0;  // index in crcs of the run's first page
    for (const PageRun& r : runs) {
      const char* at = pool.buffer(b) + uint64_t{dst ? r.dst : r.src} * pb;
      const uint64_t length = uint64_t{r.count} * pb;
      if (pool.device(b) < 0) {
        for (uint32_t i = 0; i < r.count; ++i) {
          crcs[first + i] = Crc32c(at + i * pb, pb, crcs[first + i]);
        }
      } else {
        const cuda::Driver* driver = cuda::Driver::Get();
        uint64_t pos = 0;  // bytes of the run read so far
        RETURN_IF_ERROR(
            driver->ReadDevice(at, length, pool.device(b), [&](const char* bytes, size_t n) {
              while (n > 0) {
                const uint64_t page = pos / pb;
                const size_t part = static_cast<size_t>(std::min<uint64_t>(n, pb - pos % pb));
                crcs[first + page] = Crc32c(bytes, part, crcs[first + page]);
                bytes += part;
                n -= part;
                pos += part;
              }
            }));
      }
      first += r.count;
    }
  }
  return crcs;
}

bool GetU32(absl::string_view* in, uint32_t* v) {
  if (in->size() < 4) return false;
  std::memcpy(v, in->data(), 4);
  in->remove_prefix(4);
  return true;
}

absl::StatusOr<std::string> ChecksummedBody(const KvPool& pool, const std::vector<PageRun>& runs,
                                            absl::string_view aux) {
  ASSIGN_OR_RETURN(std::vector<uint32_t> crcs, PageCrcs(pool, runs, /*dst=*/false));
  std::string out;
  PutU32(&out, static_cast<uint32_t>(runs.size()));
  for (const PageRun& r : runs) {
    PutU32(&out, r.dst);
    PutU32(&out, r.count);
  }
  for (uint32_t crc : crcs) PutU32(&out, crc);
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
