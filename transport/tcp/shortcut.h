// The TCP transport's in-process shortcut: between two TCP transports of one
// process (TcpTransportOptions::in_process_shortcut) a request skips the
// socket, and the requester copies straight between the regions, with the
// same key, bounds and access checks the wire's responder makes.
//
// Every transport that takes part joins the process's Shortcuts under a
// random in-process key, which its link parameters carry. A link to a
// member holds the gate of the peer's end of the link (DirectGate): open
// while that end is, and closing it waits for the copies under way, so
// that once the peer's CloseLink returns nothing sent on the link lands (a
// fenced peer's shortcut copies included).
//
// Thread-safe. Internal to transport/tcp.
#ifndef KVFERRY_TRANSPORT_TCP_SHORTCUT_H_
#define KVFERRY_TRANSPORT_TCP_SHORTCUT_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "transport/tcp/region_table.h"
#include "transport/transport.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

// One end of a link, as the other end's shortcut copies enter it.
class DirectGate {
 public:
  // False once closed; else the caller copies, then calls Exit.
  bool Enter() ABSL_LOCKS_EXCLUDED(mu_);
  void Exit() ABSL_LOCKS_EXCLUDED(mu_);
  // No copy starts after this; with `wait`, none is running when it returns.
  void Close(bool wait) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs of copies the peer made through it: its input (InputCount).
  uint64_t entries() const { return entries_.load(std::memory_order_relaxed); }

 private:
  Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  uint32_t users_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> entries_{0};
  CondVar cv_;
};

class Shortcuts {
 public:
  // What the shortcut needs of a member transport.
  struct Member {
    RegionTable* regions = nullptr;  // outlives its membership
    // The gate of its link with `token` made by AcceptLink (`passive`) or
    // OfferLink; null if there is none. Takes the member's own locks.
    std::function<std::shared_ptr<DirectGate>(uint64_t token, bool passive)> gate;
  };
  // One request on a link whose peer is a member.
  struct Copy {
    const void* link = nullptr;  // the requests of one link come together
    DirectGate* gate = nullptr;  // the peer end's (null: none), kept by the caller
    uint64_t peer_key = 0;
    WorkRequest wr;
    int local_device = -1;  // the local buffer's CUDA device, -1: host
    bool run = false;       // the caller's: still outstanding when the copies begin
    absl::Status status;    // the outcome, for those that ran
  };

  // The process's members.
  static Shortcuts& Get();

  // Makes `member` a member; returns its key (never 0).
  uint64_t Join(Member member) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends membership `key`, once no shortcut copy into its regions runs.
  void Leave(uint64_t key) ABSL_LOCKS_EXCLUDED(mu_);
  // Member `key`'s gate (Member::gate); null when `key` is not a member of
  // this process (0, another process's, or one a fork() inherited).
  // Takes the member's locks: never call it holding one of the caller's
  // own that a member's gate function takes.
  std::shared_ptr<DirectGate> GateOf(uint64_t key, uint64_t token, bool passive)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Copies each request with `run` set, checked against its peer's
  // regions, through its peer end's gate (entered once per run of requests
  // of one link); sets its status. A closed gate or a peer gone fails the
  // request with kUnavailable, a refused check with the check's code.
  void CopyAll(absl::Span<Copy* const> copies) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    Member member;
    pid_t pid;  // a child made by fork() inherits entries that are not its own
  };
  // One request's bytes, `peer`'s regions' lock held (shared).
  static absl::Status CopyOne(RegionTable& peer, const Copy& c)
      ABSL_SHARED_LOCKS_REQUIRED(peer.mu());

  // Held shared while a shortcut copy runs, so that a member is not
  // destroyed under it.
  SharedMutex mu_;
  absl::flat_hash_map<uint64_t, Entry> by_key_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_SHORTCUT_H_
