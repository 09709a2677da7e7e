#include "kv/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "cuda/driver.h"
#include "net/socket.h"

namespace kvferry {

// ---------------------------------------------------------------- layout

absl::Status KvLayout::Validate() const {
  if (layers == 0 || layers > 4096 || page_tokens == 0 || bytes_per_token == 0 || pages == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad KV layout: layers=", layers, " page_tokens=", page_tokens,
        " bytes_per_token=", bytes_per_token, " pages=", pages, " (all must be positive)"));
  }
  if (bytes_per_token > (uint64_t{1} << 30) / page_tokens ||
      page_bytes() > (uint64_t{1} << 44) / pages) {
    return absl::InvalidArgumentError("bad KV layout: buffers would exceed 16 TiB");
  }
  return absl::OkStatus();
}

std::string KvLayout::Encode() const {
  return absl::StrCat("kv1 layers=", layers, " combined=", combined_kv ? 1 : 0,
                      " page_tokens=", page_tokens, " bytes_per_token=", bytes_per_token,
                      " pages=", pages);
}

absl::StatusOr<KvLayout> KvLayout::Decode(absl::string_view text) {
  std::vector<absl::string_view> fields = absl::StrSplit(text, ' ');
  KvLayout l;
  uint32_t combined = 0;
  bool ok = fields.size() == 6 && fields[0] == "kv1";
  for (size_t i = 1; ok && i < fields.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(fields[i], '=');
    if (kv.first == "layers")
      ok = absl::SimpleAtoi(kv.second, &l.layers);
    else if (kv.first == "combined")
      ok = absl::SimpleAtoi(kv.second, &combined);
    else if (kv.first == "page_tokens")
      ok = absl::SimpleAtoi(kv.second, &l.page_tokens);
    else if (kv.first == "bytes_per_token")
      ok = absl::SimpleAtoi(kv.second, &l.bytes_per_token);
    else if (kv.first == "pages")
      ok = absl::SimpleAtoi(kv.second, &l.pages);
    else
      ok = false;
  }
  if (!ok) return absl::DataLossError(absl::StrCat("malformed KV layout '", text, "'"));
  l.combined_kv = combined != 0;
  RETURN_IF_ERROR(l.Validate());
  return l;
}

// ---------------------------------------------------------------- pool

absl::StatusOr<KvPool> KvPool::Allocate(const KvLayout& layout) {
  RETURN_IF_ERROR(layout.Validate());
  const uint64_t total = layout.buffer_bytes() * layout.buffer_count();
  char* memory = static_cast<char*>(std::calloc(total, 1));
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a KV pool of ", total, " bytes"));
  }
  KvPool pool;
  pool.layout_ = layout;
  pool.storage_ = std::shared_ptr<char>(memory, [](char* p) { std::free(p); });
  for (uint32_t b = 0; b < layout.buffer_count(); ++b) {
    pool.buffers_.push_back(memory + b * layout.buffer_bytes());
  }
  return pool;
}

absl::StatusOr<KvPool> KvPool::Wrap(const KvLayout& layout, std::vector<void*> buffers) {
  RETURN_IF_ERROR(layout.Validate());
  if (buffers.size() != layout.buffer_count()) {
    return absl::InvalidArgumentError(absl::StrCat("a layout of ", layout.layers, " layers needs ",
                                                   layout.buffer_count(), " buffers; got ",
                                                   buffers.size()));
  }
  for (void* b : buffers) {
    if (b == nullptr) return absl::InvalidArgumentError("null KV buffer");
  }
  KvPool pool;
  pool.layout_ = layout;
  if (const cuda::Driver* driver = cuda::Driver::Get()) {
    bool any = false;
    for (void* b : buffers) {
      ASSIGN_OR_RETURN(cuda::MemoryInfo where, driver->Classify(b, layout.buffer_bytes()));
      pool.devices_.push_back(where.device ? where.ordinal : -1);
      any = any || where.device;
    }
    if (!any) pool.devices_.clear();
  }
  pool.buffers_ = std::move(buffers);
  return pool;
}

absl::Status KvPool::Register(TransferEngine& engine, transport::Access access) const {
  if (contiguous()) {
    return engine.RegisterMemory(buffers_[0], layout_.buffer_bytes() * layout_.buffer_count(),
                                 access);
  }
  for (void* b : buffers_)
    RETURN_IF_ERROR(engine.RegisterMemory(b, layout_.buffer_bytes(), access));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- coalescing

absl::StatusOr<std::vector<PageRun>> CoalescePages(absl::Span<const uint32_t> src,
                                                   absl::Span<const uint32_t> dst) {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(src.size(), " source pages but ", dst.size(), " destination pages"));
  }
  // Pages on one diagonal (dst - src) with consecutive dst form a run; with
  // unique destinations each page has at most one successor, so grouping by
  // diagonal and merging consecutive destinations gives the fewest runs.
  std::vector<std::pair<uint32_t, uint32_t>> pairs;  // (dst, src)
  pairs.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) pairs.emplace_back(dst[i], src[i]);
  std::sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) {
    const int64_t da = int64_t{a.first} - a.second, db = int64_t{b.first} - b.second;
    return da != db ? da < db : a.first < b.first;
  });
  std::vector<PageRun> runs;
  std::vector<uint32_t> seen_dst;
  seen_dst.reserve(pairs.size());
  for (const auto& [d, s] : pairs) {
    seen_dst.push_back(d);
    if (!runs.empty()) {
      PageRun& last = runs.back();
      if (uint64_t{last.dst} + last.count == d && uint64_t{last.src} + last.count == s) {
        ++last.count;
        continue;
      }
    }
    runs.push_back(PageRun{s, d, 1});
  }
  std::sort(seen_dst.begin(), seen_dst.end());
  auto dup = std::adjacent_find(seen_dst.begin(), seen_dst.end());
  if (dup != seen_dst.end()) {
    return absl::InvalidArgumentError(absl::StrCat("destination page ", *dup, " appears twice"));
  }
  std::sort(runs.begin(), runs.end(),
            [](const PageRun& a, const PageRun& b) { return a.src < b.src; });
  return runs;
}

}  // namespace kvferry
