#include "transport/in_process.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvferry {
namespace transport {

absl::StatusOr<std::pair<LinkId, LinkId>> ConnectInProcess(Transport& a,
                                                           Transport& b,
                                                           NicIndex na,
                                                           NicIndex nb) {
  const EndpointDescription ea = a.LocalEndpoint();
  const EndpointDescription eb = b.LocalEndpoint();
  if (na >= ea.nics.size() || nb >= eb.nics.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NIC index out of range: ", na, " of ", ea.nics.size(), ", ", nb,
        " of ", eb.nics.size()));
  }
  ASSIGN_OR_RETURN(LinkOffer offer, a.CreateLink(na, eb.nics[nb]));
  ASSIGN_OR_RETURN(LinkOffer answer,
                   b.AcceptLink(nb, ea.nics[na], offer.params));
  RETURN_IF_ERROR(a.CompleteLink(offer.link, answer.params));
  return std::make_pair(offer.link, answer.link);
}

}  // namespace transport
}  // namespace kvferry
