#include "kv/watch_set.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace kvferry {
namespace kv_internal {

WatchSet::WatchSet() : wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

void WatchSet::Wake() {
  if (!wake_.valid()) return;
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void WatchSet::Add(const std::string& peer, net::Fd watch) {
  watches_.emplace(peer, std::move(watch));
  Wake();
}

void WatchSet::Remove(const std::string& peer) {
  auto w = watches_.find(peer);
  if (w == watches_.end()) return;
  retired_.push_back(std::move(w->second));  // a Wait may be polling it
  watches_.erase(w);
  Wake();
}

std::vector<std::string> WatchSet::Wait(Mutex* mu, CondVar* cv, absl::Duration wait) {
  if (!wake_.valid()) {  // no eventfd: the condition variable, without watches
    cv->WaitWithTimeout(mu, wait);
    return {};
  }
  std::vector<pollfd> fds;
  std::vector<std::string> peers;
  fds.push_back(pollfd{wake_.get(), POLLIN, 0});
  for (const auto& [peer, fd] : watches_) {
    fds.push_back(pollfd{fd.get(), POLLIN | POLLRDHUP, 0});
    peers.push_back(peer);
  }
  mu->Unlock();
  const int ms = static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), 1 << 30));
  (void)::poll(fds.data(), fds.size(), ms);
  if (fds[0].revents != 0) {
    uint64_t n;
    (void)!::read(wake_.get(), &n, sizeof n);
  }
  mu->Lock();
  std::vector<std::string> ended;
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    // The peer sends nothing on a watch: any event is its end (or reset).
    auto w = watches_.find(peers[i - 1]);
    if (w == watches_.end() || w->second.get() != fds[i].fd) continue;
    retired_.push_back(std::move(w->second));
    watches_.erase(w);
    ended.push_back(peers[i - 1]);
  }
  retired_.clear();  // no poll on them any more
  return ended;
}

}  // namespace kv_internal
}  // namespace kvferry
