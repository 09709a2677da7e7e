// An extension of Network (Network::QueryExtension) for networks whose calls
// run on connections of their own and carry frames as they are (TCP, not the
// authenticated decorator, which wraps them): a reply may hand its
// connection over to a new owner on both ends. The engine uses it so that
// the first link to a new peer runs on the handshake's connection
// (kConnectLinksHere; transport/stream_links.h for the transport's half).
// The base Network stays free of file descriptors.
#ifndef KVFERRY_HANDSHAKE_HAND_OVER_H_
#define KVFERRY_HANDSHAKE_HAND_OVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "handshake/network.h"
#include "net/socket.h"

namespace kvferry {
namespace handshake {

// Takes over a connection the handshake ran on: from then on it carries
// something else, and the network forgets it.
using TakeConnection = std::function<void(net::Fd connection)>;

// A reply, and who takes the connection once it is written (null: the
// server goes on serving the connection).
struct Answer {
  // A plain reply converts: the connection stays with the server.
  Answer(Frame r, TakeConnection t = nullptr)  // NOLINT(google-explicit-constructor)
      : reply(std::move(r)), take(std::move(t)) {}
  Frame reply;
  TakeConnection take;
};
// Answers one request, as Handler does, and may hand the connection over.
using HandingHandler = std::function<Answer(const Frame& request)>;

class HandOver {
 public:
  static constexpr absl::string_view kName = "kvferry.handshake.hand_over";

  // Network::Serve with a handler that may hand connections over. A
  // connection with bytes after a request whose answer hands it over is
  // refused instead (the requester must wait for the reply).
  virtual absl::StatusOr<std::unique_ptr<Server>> ServeHandingOver(const ServeOptions& options,
                                                                   HandingHandler handler) = 0;
  // Network::CallPipelined; then, when every reply came, `take` may take
  // the connection they came on (it returns true when it did, and the
  // network forgets the connection). For a last request whose answer hands
  // the peer's end over too.
  using TakeFn = std::function<bool(net::Fd& connection)>;
  virtual void CallThenTake(const std::string& peer, const std::vector<Frame>& requests,
                            absl::Duration timeout, const Network::ReplyFn& on_reply,
                            const TakeFn& take) = 0;

 protected:
  ~HandOver() = default;
};

}  // namespace handshake
}  // namespace kvferry

#endif  // KVFERRY_HANDSHAKE_HAND_OVER_H_
