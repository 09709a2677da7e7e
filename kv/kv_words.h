// The KV layer's completion words (notifications between a KvSender and a
// KvReceiver) and the helpers both sides share. Internal to engine/kv_*.cc.
#ifndef KVFERRY_KV_KV_WORDS_H_
#define KVFERRY_KV_KV_WORDS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kv/kv_cache.h"

namespace kvferry {
namespace kv_internal {

constexpr size_t kMaxAuxBytes = 512 << 10;
// The third line of a receiver's published pool when it reads "begn" words
// (an older receiver would leave it to the application as a notification
// of its own).
constexpr char kReadsBeginWords[] = "begn";
constexpr char kSep = '\0';

// KV-layer notifications, "kv2\0<kind>\0<id>\0<token>\0<body>": begn
// (begun; body: the sender's handshake address, so that a decode that
// waits without Expect knows whom to watch), done (body: aux), donc (done
// with per-page checksums), fail (failed before any write was posted;
// body: the reason) and abrt (failed after writes were posted: the
// receiver drops the sender's links before it reports the failure, so that
// no late copy of them lands afterwards). <token> (16 hex
// digits) names the attempt: a word said again, or one from an earlier
// attempt at a request id the decode has since forgotten and expects again,
// is recognised and ignored. Receivers still read "kv1" words (no token).
std::string KvMessage(absl::string_view kind, absl::string_view id, uint64_t token,
                      absl::string_view body);

// A KV word as KvMessage writes it (or an older sender's "kv1" word, no
// token); nullopt for any other notification. Views into `message`.
struct Word {
  absl::string_view kind, id, body;
  uint64_t token = 0;
};
std::optional<Word> ParseWord(absl::string_view message);

// A fresh attempt token: random per process, then counted.
uint64_t NewToken();

// The CRC-32C of every page of `runs` (their src pages, or with `dst`
// their dst pages), in run order; a page's CRC runs across every buffer of
// `pool`, K and V of every layer. Device buffers are read through the
// driver (cuda::Driver::ReadDevice), host buffers in place.
absl::StatusOr<std::vector<uint32_t>> PageCrcs(const KvPool& pool, const std::vector<PageRun>& runs,
                                               bool dst);

bool GetU32(absl::string_view* in, uint32_t* v);

// The body of a "donc" message: u32 runs, (u32 dst, u32 count) each, the
// CRC of every destination page in run order, then the aux payload.
absl::StatusOr<std::string> ChecksummedBody(const KvPool& pool, const std::vector<PageRun>& runs,
                                            absl::string_view aux);

absl::Status CheckRequestId(const std::string& id);

}  // namespace kv_internal
}  // namespace kvferry

#endif  // KVFERRY_KV_KV_WORDS_H_
