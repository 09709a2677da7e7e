#include "transport/tcp/region_table.h"

#include <sys/socket.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "net/socket.h"
#include "transport/checks.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

RegionTable::Use::~Use() {
  if (entry_ == nullptr) return;
  MutexLock lock(&entry_->use_mu);
  auto& fds = entry_->using_fds;
  fds.erase(std::find(fds.begin(), fds.end(), fd_));
  if (fds.empty()) entry_->use_cv.SignalAll();
}

Region RegionTable::Add(uint64_t base, uint64_t length, Access access, int device,
                        std::unique_ptr<HostShare::Export> share) {
  WriterMutexLock lock(&mu_);
  auto entry = std::make_shared<Entry>();
  entry->device = device;
  entry->share = std::move(share);
  Region& r = entry->region;
  r.id = ++last_;
  r.addr = base;
  r.length = length;
  r.access = access;
  RemoteKey key;
  do {
    key = net::RandomU64();
  } while (key == 0 || by_key_.contains(key));
  r.keys = {key};
  by_key_[key] = entry.get();
  Region out = r;
  regions_.emplace(r.id, std::move(entry));
  return out;
}

absl::Status RegionTable::Remove(RegionId id) {
  std::shared_ptr<Entry> entry;
  {
    WriterMutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("unknown region ", id));
    if (const uint64_t uses = it->second->local_uses.load(); uses != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("region ", id, " is used by ", uses, " outstanding request(s)"));
    }
    by_key_.erase(it->second->region.keys[0]);
    entry = std::move(it->second);
    regions_.erase(it);
  }
  entry->share.reset();  // peers on this host can open it no more
  RevokeAndDrain(*entry);
  return absl::OkStatus();
}

void RegionTable::RevokeAndDrain(Entry& entry) {
  constexpr absl::Duration kGrace = absl::Seconds(1);
  MutexLock lock(&entry.use_mu);
  entry.revoked.store(true, std::memory_order_release);
  if (entry.use_cv.AwaitWithDeadline(
          &entry.use_mu, absl::Now() + kGrace,
          [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return entry.using_fds.empty(); })) {
    return;
  }
  KVF_LOG(WARNING) << "tcp: region " << entry.region.id << " unregistered while "
                   << entry.using_fds.size() << " peer request(s) still moved its bytes after "
                   << absl::FormatDuration(kGrace) << ": closing their links";
  for (int fd : entry.using_fds) ::shutdown(fd, SHUT_RDWR);
  while (!entry.using_fds.empty()) entry.use_cv.Wait(&entry.use_mu);
}

int RegionTable::DeviceOf(RegionId id) {
  ReaderMutexLock lock(&mu_);
  const Entry* e = Find(id);
  return e == nullptr ? -1 : e->device;
}

absl::Status RegionTable::CheckRemote(const tcp_wire::DataHeader& h, bool write, char** target,
                                      int* device) {
  auto it = by_key_.find(h.rkey);
  if (it == by_key_.end()) return UnknownKeyError(h.rkey);
  RETURN_IF_ERROR(CheckRemoteAccess(it->second->region, write ? Opcode::kWrite : Opcode::kRead,
                                    h.remote_addr, h.length));
  *target = reinterpret_cast<char*>(h.remote_addr);
  if (device != nullptr) *device = it->second->device;
  return absl::OkStatus();
}

absl::StatusOr<RegionTable::Use> RegionTable::UseRemote(const tcp_wire::DataHeader& h, bool write,
                                                        int fd, char** target, int* device) {
  ReaderMutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckRemote(h, write, target, device));
  // CheckRemote found the key: one more lookup of it, none by region id.
  std::shared_ptr<Entry> entry = by_key_.find(h.rkey)->second->shared_from_this();
  MutexLock use(&entry->use_mu);
  if (entry->revoked.load(std::memory_order_relaxed)) return UnknownKeyError(h.rkey);
  entry->using_fds.push_back(fd);
  return Use(std::move(entry), fd);
}

absl::Status RegionTable::UseRemoteHeld(const tcp_wire::DataHeader& h, bool write, int fd,
                                        Held* held, char** target, int* device) {
  if (held->use_.has_value()) {
    // Safe without mu_: the held Use keeps the entry alive and its region
    // registered (Remove waits for it), and a region's fields never change.
    const Entry& e = *held->use_->entry();
    if (e.region.keys[0] == h.rkey && !e.revoked.load(std::memory_order_acquire)) {
      RETURN_IF_ERROR(CheckRemoteAccess(e.region, write ? Opcode::kWrite : Opcode::kRead,
                                        h.remote_addr, h.length));
      *target = reinterpret_cast<char*>(h.remote_addr);
      *device = e.device;
      return absl::OkStatus();
    }
    held->use_.reset();
  }
  ASSIGN_OR_RETURN(Use use, UseRemote(h, write, fd, target, device));
  held->use_.emplace(std::move(use));
  return absl::OkStatus();
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
