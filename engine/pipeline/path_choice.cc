#include "engine/pipeline/path_choice.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/driver.h"
#include "transport/kinds.h"

namespace kvferry {
namespace engine_internal {

namespace {

using transport::kind::kCudaIpc;
using transport::kind::kTcp;

// The first transport after the primary of `kind`; mine.size() if none.
size_t FallbackOf(absl::Span<const std::string> mine, const std::string& kind) {
  for (size_t via = 1; via < mine.size(); ++via) {
    if (mine[via] == kind) return via;
  }
  return mine.size();
}

PathStep Step(PathStep::Action action, size_t via, std::string kind, std::string why) {
  PathStep s;
  s.action = action;
  s.via = via;
  s.kind = std::move(kind);
  s.why = std::move(why);
  return s;
}

PathStep Fail(absl::Status error) {
  PathStep s;
  s.error = std::move(error);
  return s;
}

// Steps 3 and 4, once the peer's primary is known.
PathStep AfterDescribe(absl::Span<const std::string> mine, const PeerFacts& theirs) {
  const bool same_primary = theirs.primary == mine[0];
  const bool primary_failed =
      same_primary && !theirs.failed.empty() && theirs.failed[0].first == mine[0];
  if (!theirs.failed.empty() && (!primary_failed || theirs.failed.size() > 1)) {
    return Fail(theirs.failed.back().second);  // a fallback failed
  }
  if (same_primary && !primary_failed) {
    return Step(PathStep::Action::kConnect, 0, mine[0], absl::StrCat("both ends have ", mine[0]));
  }
  for (size_t via = same_primary ? 1 : 0; via < mine.size(); ++via) {
    if (theirs.lacks.contains(mine[via]) || (primary_failed && mine[via] == mine[0])) continue;
    if (mine[via] == kCudaIpc) continue;  // same-host peers only: step 1
    std::string why = same_primary ? absl::StrCat(mine[0], " links to the peer failed (",
                                                  theirs.failed[0].second.message(),
                                                  "); fell back to ", mine[via])
                                   : absl::StrCat("the peer's primary transport is ",
                                                  theirs.primary, "; both ends have ", mine[via]);
    return Step(PathStep::Action::kConnect, via, mine[via], std::move(why));
  }
  if (primary_failed) return Fail(theirs.failed[0].second);
  return Fail(absl::FailedPreconditionError(
      absl::StrCat("peer ", theirs.address, " uses the ", theirs.primary,
                   " transport; this engine has ", absl::StrJoin(mine, " and "))));
}

}  // namespace

HostFacts HostFacts::OfThisHost() {
  HostFacts f;
  f.cuda = cuda::Driver::Get() != nullptr;
  absl::StatusOr<std::vector<net::InterfaceAddress>> mine = net::ListInterfaceAddresses();
  if (mine.ok()) f.addresses = std::move(*mine);
  return f;
}

PathStep ChoosePath(absl::Span<const std::string> mine, const PeerFacts& theirs,
                    const HostFacts& facts) {
  if (mine.empty()) return Fail(absl::FailedPreconditionError("this engine has no transport"));
  const size_t same_host = FallbackOf(mine, kCudaIpc);
  if (same_host < mine.size() && facts.cuda && !theirs.same_host_tried && theirs.primary.empty() &&
      net::IsThisHost(theirs.host, facts.addresses)) {
    return Step(PathStep::Action::kConnect, same_host, kCudaIpc,
                "the peer is on this host: cuda_ipc, device memory copied GPU to GPU");
  }
  const bool tcp_only =
      mine[0] == kTcp && (mine.size() == 1 || (mine.size() == 2 && mine[1] == kCudaIpc));
  if (tcp_only && !theirs.one_round_trip_tried && theirs.primary.empty()) {
    return Step(PathStep::Action::kOneRoundTrip, 0, kTcp,
                "this engine has only tcp; the peer has it too");
  }
  if (theirs.primary.empty()) return Step(PathStep::Action::kDescribe, 0, "", "");
  return AfterDescribe(mine, theirs);
}

}  // namespace engine_internal
}  // namespace kvferry
