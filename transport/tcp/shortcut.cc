#include "transport/tcp/shortcut.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "base/status_macros.h"
#include "cuda/driver.h"
#include "net/socket.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

bool DirectGate::Enter() {
  MutexLock lock(&mu_);
  if (!open_) return false;
  ++users_;
  entries_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void DirectGate::Exit() {
  MutexLock lock(&mu_);
  if (--users_ == 0) cv_.SignalAll();
}

void DirectGate::Close(bool wait) {
  MutexLock lock(&mu_);
  open_ = false;
  while (wait && users_ > 0) cv_.Wait(&mu_);
}

Shortcuts& Shortcuts::Get() {
  static Shortcuts* s = new Shortcuts;
  return *s;
}

uint64_t Shortcuts::Join(Member member) {
  WriterMutexLock lock(&mu_);
  uint64_t key;
  do {
    key = net::RandomU64();
  } while (key == 0 || by_key_.contains(key));
  by_key_[key] = Entry{std::move(member), ::getpid()};
  return key;
}

void Shortcuts::Leave(uint64_t key) {
  WriterMutexLock lock(&mu_);  // waits for the copies under way (CopyAll)
  by_key_.erase(key);
}

std::shared_ptr<DirectGate> Shortcuts::GateOf(uint64_t key, uint64_t token, bool passive) {
  if (key == 0) return nullptr;
  ReaderMutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end() || it->second.pid != ::getpid()) return nullptr;
  return it->second.member.gate(token, passive);
}

absl::Status Shortcuts::CopyOne(RegionTable& peer, const Copy& c) {
  tcp_wire::DataHeader h;
  h.remote_addr = c.wr.remote_addr;
  h.rkey = c.wr.remote_key;
  h.length = c.wr.length;
  char* remote = nullptr;
  const bool write = c.wr.opcode == Opcode::kWrite;
  int remote_device = -1;
  RETURN_IF_ERROR(peer.CheckRemote(h, write, &remote, &remote_device));
  void* dst = write ? static_cast<void*>(remote) : c.wr.local_addr;
  const void* src = write ? static_cast<const void*>(c.wr.local_addr) : remote;
  if (c.local_device < 0 && remote_device < 0) {
    std::memcpy(dst, src, c.wr.length);
    return absl::OkStatus();
  }
  // Device memory on either end: the driver's copy (device to device stays
  // on the GPUs).
  return cuda::Driver::Get()->Copy(dst, src, c.wr.length,
                                   c.local_device >= 0 ? c.local_device : remote_device);
}

// It holds the regions lock of whichever peer the current request goes to,
// switching as the peer changes: beyond what the thread-safety analysis can
// follow, so it is not analysed.
void Shortcuts::CopyAll(absl::Span<Copy* const> copies) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  ReaderMutexLock members(&mu_);
  RegionTable* peer = nullptr;
  uint64_t peer_key = 0;
  // The peer end's gate, entered once for a run of requests on one link.
  DirectGate* entered = nullptr;
  const void* gated = nullptr;
  for (Copy* c : copies) {
    if (!c->run || c->wr.length == 0) continue;
    if (c->link != gated) {
      if (entered != nullptr) entered->Exit();
      gated = c->link;
      entered = c->gate != nullptr && c->gate->Enter() ? c->gate : nullptr;
    }
    if (entered == nullptr) {
      // The peer closed its end (a fence, say): nothing more lands there.
      c->status = absl::UnavailableError("the peer closed the link");
      continue;
    }
    if (c->peer_key != peer_key || peer == nullptr) {
      if (peer != nullptr) peer->mu().ReaderUnlock();
      auto it = by_key_.find(c->peer_key);
      peer = it == by_key_.end() ? nullptr : it->second.member.regions;
      peer_key = c->peer_key;
      if (peer != nullptr) peer->mu().ReaderLock();
    }
    if (peer == nullptr) {
      c->status = absl::UnavailableError("the peer transport in this process is gone");
      continue;
    }
    c->status = CopyOne(*peer, *c);  // its regions' lock is held
  }
  if (entered != nullptr) entered->Exit();
  if (peer != nullptr) peer->mu().ReaderUnlock();
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
