// A KvReceiver's watcher's wake-up and its watch connections: an idle
// connection to each watched prefill's handshake port, opened after a probe
// it answered. Its process's death closes it at once (the kernel's FIN), so
// the watcher probes that prefill then instead of at its turn.
//
// Not thread-safe: the receiver holds it under its own lock, which Wait
// releases while it polls. A connection removed while a Wait polls it stays
// open until that Wait is done (its fd number is not reused under the poll).
#ifndef KVFERRY_KV_WATCH_SET_H_
#define KVFERRY_KV_WATCH_SET_H_

#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "base/mutex.h"
#include "net/socket.h"

namespace kvferry {
namespace kv_internal {

class WatchSet {
 public:
  WatchSet();

  // Makes a Wait in progress (or the next one) return.
  void Wake();
  bool Has(const std::string& peer) const { return watches_.count(peer) != 0; }
  // Polls `watch` as `peer`'s connection from now on (and wakes a Wait to
  // include it).
  void Add(const std::string& peer, net::Fd watch);
  // Stops watching `peer` (and wakes a Wait to leave it out).
  void Remove(const std::string& peer);
  // Waits up to `wait` for a wake-up or the end of a watch connection, with
  // `mu` released meanwhile (held on entry and on return; without an
  // eventfd, on `cv` and without watches). Returns the peers whose
  // connection ended; they are no longer watched.
  std::vector<std::string> Wait(Mutex* mu, CondVar* cv, absl::Duration wait)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

 private:
  net::Fd wake_;  // an eventfd
  std::map<std::string, net::Fd> watches_;
  std::vector<net::Fd> retired_;  // removed, maybe still polled by a Wait
};

}  // namespace kv_internal
}  // namespace kvferry

#endif  // KVFERRY_KV_WATCH_SET_H_
