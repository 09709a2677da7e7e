// The handshake server's budget for partial requests: what a connection
// may hold, who goes when the budget is full (tcp_server.h has the rules).
#include <algorithm>

#include "base/status_macros.h"
#include "handshake/tcp_server_state.h"

namespace kvferry {
namespace handshake {

using server_internal::kSmallClaim;

absl::StatusOr<FrameHeader> TcpServer::State::Header(absl::string_view in) const {
  ASSIGN_OR_RETURN(FrameHeader h, ParseFrameHeader(in, options.max_request_bytes));
  if (h.payload_bytes > MaxRequestPayloadBytes(h.type)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a ", MessageTypeName(h.type), " request of ", h.payload_bytes,
                     " bytes: at most ", MaxRequestPayloadBytes(h.type), " are allowed"));
  }
  return h;
}

// Once the head request's header is in: a large claim counts against its
// source's share (refused beyond it). False when the connection was closed.
bool TcpServer::State::Classify(uint64_t id, Conn* c) {
  if (c->large || c->in.size() < kFrameHeaderBytes) return true;
  absl::StatusOr<FrameHeader> h = Header(c->in);
  if (!h.ok() || h->payload_bytes <= kSmallClaim) return true;  // Dispatch refuses a bad one
  size_t& mine = large_by_source[c->source];
  if (mine >= options.max_large_per_source) {
    ++shed;
    Refuse(id, c,
           absl::ResourceExhaustedError(
               absl::StrCat(options.max_large_per_source, " large requests from ", c->source,
                            " are in progress already; send it again when one has been answered")));
    return false;
  }
  ++mine;
  c->large = true;
  large_buffered += c->in.size();
  return true;
}

// The head request leaves `in` (answered, refused, or the connection closed).
void TcpServer::State::Unclassify(Conn* c) {
  if (!c->large) return;
  c->large = false;
  large_buffered -= c->in.size();
  auto it = large_by_source.find(c->source);
  if (it != large_by_source.end() && --it->second == 0) large_by_source.erase(it);
}

// Over the budget, the connection holding the most partial bytes goes, not
// the one that read last (unless it is that one): small requests have the
// whole budget, large ones all but `small_headroom`, so a probe, challenge,
// describe or connect-links always fits however many large requests hog
// the rest. False when `c` itself was closed.
bool TcpServer::State::WithinBudget(uint64_t id, Conn* c) {
  const size_t headroom =
      options.small_headroom == 0 ? options.max_buffered_bytes / 4 : options.small_headroom;
  const size_t large_cap =
      options.max_buffered_bytes - std::min(headroom, options.max_buffered_bytes);
  for (;;) {
    const bool over = buffered > options.max_buffered_bytes;
    const bool large_over = c->large && large_buffered > large_cap;
    if (!over && !large_over) return true;
    // The largest holder among the others; over the large cap, a large one.
    uint64_t victim = 0;
    size_t most = c->in.size();
    for (const auto& [other, o] : conns) {
      if (other != id && o->in.size() > most && (!large_over || over || o->large)) {
        most = o->in.size();
        victim = other;
      }
    }
    ++shed;
    Warn(absl::StrCat("the request buffers are full (", buffered, " bytes, ", large_buffered,
                      " in large requests): closing the connection holding the most"));
    if (victim == 0) {
      Close(id);
      return false;
    }
    Close(victim);
  }
}

}  // namespace handshake
}  // namespace kvferry
