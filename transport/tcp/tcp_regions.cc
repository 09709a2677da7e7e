// TcpTransport: registered memory, and the peers' use of it (a region is
// revoked and drained before it is unregistered).
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::StatusOr<Region> TcpTransport::RegisterMemory(void* addr, uint64_t length, Access access) {
  if (addr == nullptr) return absl::InvalidArgumentError("RegisterMemory: null address");
  if (length == 0) return absl::InvalidArgumentError("RegisterMemory: zero length");
  if (length > options_.max_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "RegisterMemory: ", length, " bytes exceeds the limit of ", options_.max_region_bytes));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(addr);
  if (base + length < base) return absl::InvalidArgumentError("RegisterMemory: range wraps");
  // Device memory is never touched by the CPU: its bytes go through pinned
  // staging buffers (see Staging).
  int device = -1;
  if (const cuda::Driver* driver = cuda::Driver::Get()) {
    ASSIGN_OR_RETURN(cuda::MemoryInfo where, driver->Classify(addr, length));
    if (where.device) device = where.ordinal;
  }
  std::unique_ptr<HostShare::Export> share =
      options_.host_share != nullptr ? options_.host_share->Share(addr, length, device) : nullptr;
  WriterMutexLock lock(&regions_mu_);
  auto entry = std::make_shared<RegionEntry>();
  entry->device = device;
  entry->share = std::move(share);
  Region& r = entry->region;
  r.id = ++last_region_;
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

absl::Status TcpTransport::UnregisterMemory(RegionId region) {
  std::shared_ptr<RegionEntry> entry;
  {
    WriterMutexLock lock(&regions_mu_);
    auto it = regions_.find(region);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("unknown region ", region));
    if (const uint64_t uses = it->second->local_uses.load(); uses != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("region ", region, " is used by ", uses, " outstanding request(s)"));
    }
    by_key_.erase(it->second->region.keys[0]);
    entry = std::move(it->second);
    regions_.erase(it);
  }
  entry->share.reset();  // peers on this host can open it no more
  RevokeAndDrain(*entry);
  return absl::OkStatus();
}

void TcpTransport::RevokeAndDrain(RegionEntry& entry) {
  constexpr absl::Duration kGrace = absl::Seconds(1);
  MutexLock lock(&entry.use_mu);
  entry.revoked = true;
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

absl::StatusOr<TcpTransport::RegionUse> TcpTransport::UseRemote(const DataHeader& h, bool write,
                                                                int fd, char** target,
                                                                int* device) {
  ReaderMutexLock lock(&regions_mu_);
  RETURN_IF_ERROR(CheckRemote(h, write, target, device));
  // CheckRemote found the key: one more lookup of it, none by region id.
  std::shared_ptr<RegionEntry> entry = by_key_.find(h.rkey)->second->shared_from_this();
  MutexLock use(&entry->use_mu);
  if (entry->revoked) return UnknownKeyError(h.rkey);
  entry->using_fds.push_back(fd);
  return RegionUse(std::move(entry), fd);
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
