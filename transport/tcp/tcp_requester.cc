// The TCP transport, requester side: Post (over the socket, sent inline
// by the posting thread, or copied in-process), completions, link failure,
// and the answers that come back.
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::Status Requester::ValidateLocked(const WorkRequest& wr, Lookups& seen) {
  RETURN_IF_ERROR(LookUpLocked(wr, seen));
  return CheckLocal(wr, seen.region->region, core_.options.max_request_bytes);
}

absl::Status Requester::LookUpAgainLocked(const WorkRequest& wr, Lookups& seen) {
  if (seen.link == nullptr || wr.link != seen.link_id) {
    auto link = core_.links.find(wr.link);
    RETURN_IF_ERROR(
        CheckLinkUsable(wr.link, link == core_.links.end() ? nullptr : &link->second->state));
    seen.link_id = wr.link;
    seen.link = link->second.get();
  }
  if (seen.region == nullptr || wr.local_region != seen.region_id) {
    RegionTable::Entry* region = core_.regions.Find(wr.local_region);
    if (region == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
    }
    seen.region_id = wr.local_region;
    seen.region = region;
  }
  return absl::OkStatus();
}

absl::Status Requester::Post(absl::Span<const WorkRequest> batch) {
  // Requests to a peer in this process, copied after the locks are gone.
  Scratch<Direct> direct;
  // Links idle when this Post came: their requests go from this thread.
  Scratch<std::shared_ptr<Link>> inline_links;
  // Links whose writer has new jobs: woken once the lock is released (a
  // writer woken under it would only sleep again on the mutex).
  Scratch<std::shared_ptr<Link>> wake;
  RETURN_IF_ERROR(PostLocked(batch, *direct, *inline_links, *wake));
  for (const std::shared_ptr<Link>& link : *wake) link->cv.SignalAll();
  for (const std::shared_ptr<Link>& link : *inline_links) core_.SendInline(*link);
  inline_links->clear();  // drop the references now, not at the next Post
  wake->clear();
  if (!direct->empty()) RunDirect(*direct);
  return absl::OkStatus();
}

absl::Status Requester::PostLocked(absl::Span<const WorkRequest> batch, std::vector<Direct>& direct,
                                   std::vector<std::shared_ptr<Link>>& inline_links,
                                   std::vector<std::shared_ptr<Link>>& wake) {
  MutexLock lock(&core_.mu);
  ReaderMutexLock regions(&core_.regions.mu());
  Lookups seen;
  for (const WorkRequest& wr : batch) RETURN_IF_ERROR(ValidateLocked(wr, seen));
  RETURN_IF_ERROR(CheckLinkCapacity(
      batch,
      [this](LinkId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // core_.mu is held by Post
        return core_.links.at(id)->outstanding.size();
      },
      core_.options.max_outstanding_per_link));
  const uint64_t post = ++last_post_;
  seen = Lookups{};
  for (const WorkRequest& wr : batch) {
    (void)LookUpLocked(wr, seen);  // found and checked above
    Link& link = *seen.link;
    RegionTable::Entry& local = *seen.region;
    local.local_uses.fetch_add(1);
    const uint64_t rid = link.outstanding.Add(wr);
    if (link.peer_key != 0) {
      direct.emplace_back(core_.links.at(wr.link), rid, wr, local.device);
      continue;
    }
    if (link.jobs.empty()) link.jobs_from = post;
    Job& job = link.jobs.emplace_back();  // in place: no Job moved and destroyed
    job.header.type = wr.opcode == Opcode::kWrite ? kWriteReq : kReadReq;
    job.header.id = rid;
    job.header.remote_addr = wr.remote_addr;
    job.header.rkey = wr.remote_key;
    job.header.length = wr.length;
    const uint16_t by_ref = core_.refs.Name(
        link.share, local.share.get(),
        reinterpret_cast<uintptr_t>(wr.local_addr) - local.region.addr, wr.length, &job.ref);
    job.header.flags |= by_ref;
    job.by_ref = by_ref != 0;
    if (!job.by_ref && wr.opcode == Opcode::kWrite) {
      job.data = wr.local_addr;
      job.device = local.device;
    }
  }
  // Per link: its last request of this Post asks for the answer to the
  // run it ends, and one wake-up for the writer, not one per request.
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *core_.links.at(batch[i].link);
    if (link.peer_key != 0) continue;          // copied in Post, no message
    link.jobs.back().header.flags |= kAckNow;  // held lock: the back is this Post's
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *core_.links.at(batch[i].link);
    if (link.peer_key != 0 || link.jobs.empty()) continue;
    (ClaimInline(link, post) ? inline_links : wake).push_back(core_.links.at(batch[i].link));
  }
  return absl::OkStatus();
}

bool Requester::ClaimInline(Link& link, uint64_t post) {
  // (A passive link whose connection has not arrived yet keeps its jobs
  // queued: its writer sends them once it is attached.)
  if (!link.fd.valid() || link.writer_busy || link.inline_rest || link.stopping ||
      link.jobs_from != post || link.jobs.size() > kMaxJobsPerSend) {
    return false;
  }
  uint64_t bytes = 0;
  for (const Job& job : link.jobs) {
    if (job.device >= 0 || job.by_ref) return false;  // staged, or a reference: the writer
    bytes += job.data ? job.header.length : 0;
  }
  // Posts of up to kInlineSendBytes of data; larger ones are copied into
  // the socket by the writer while this thread goes on, so that a Submit
  // costs the caller a bounded copy. The send does not block: what the
  // socket does not take goes to the writer.
  if (bytes > kInlineSendBytes) return false;
  link.writer_busy = true;
  link.inline_jobs.swap(link.jobs);  // link.jobs is empty (and keeps its capacity)
  link.inline_sent = 0;
  return true;
}

void Requester::RunDirect(std::vector<Direct>& direct) {
  {
    MutexLock lock(&core_.mu);
    for (Direct& d : direct) {
      // Failed or closed since Post: already completed.
      Link& link = *d.link;
      d.copy.run = link.state != Link::State::kError && link.outstanding.Find(d.rid) != nullptr;
      if (d.copy.run) ++link.direct_busy;
    }
  }
  Scratch<Shortcuts::Copy*> copies;
  for (Direct& d : direct) copies->push_back(&d.copy);
  Shortcuts::Get().CopyAll(*copies);
  bool completed = false;
  {
    MutexLock lock(&core_.mu);
    for (Direct& d : direct) {
      if (!d.copy.run) continue;
      Link& link = *d.link;
      --link.direct_busy;
      if (link.idle_waiters > 0) link.cv.SignalAll();
    }
    for (Direct& d : direct) {
      if (!d.copy.run) continue;
      Link& link = *d.link;
      if (!d.copy.status.ok()) {
        // Like a refused request on the wire: the link enters the error state.
        core_.FailLink(link, std::move(d.copy.status), d.rid);
      } else if (link.outstanding.Erase(d.rid)) {
        core_.Complete(d.copy.wr, absl::OkStatus());
        completed = true;
      }
    }
    if (completed) core_.NotifyLocked();
  }
  if (completed) core_.WakeWaitersUnlocked();
}

absl::Status Requester::OnWriteAcks(Link& link, const DataHeader& h) {
  // A run of WRITEs, all landed: requests [h.id, + h.remote_addr).
  if (h.remote_addr == 0 || h.remote_addr > core_.options.max_outstanding_per_link) {
    return absl::DataLossError(absl::StrCat("WRITE ack for ", h.remote_addr, " requests"));
  }
  {
    MutexLock lock(&core_.mu);
    uint64_t bytes = 0;
    for (uint64_t id = h.id; id < h.id + h.remote_addr; ++id) {
      const WorkRequest* wr = link.outstanding.Find(id);
      if (wr == nullptr) {
        if (link.stopping) break;  // closed or failed here meanwhile
        return absl::DataLossError(absl::StrCat("answer for unknown request ", id));
      }
      bytes += wr->length;
      core_.Complete(*wr, absl::OkStatus());
      link.outstanding.Erase(id);
    }
    link.spin = bytes <= kSpinMaxRunBytes;
    // A thread waits for these: the next acknowledgements are for it (or
    // the next waiter) to read (Link::park), when the requests are small.
    if (core_.cq_waiters > 0 && core_.wake_fd.valid() &&
        bytes <= kParkMaxRequestBytes * h.remote_addr) {
      link.park = true;
    }
    core_.NotifyLocked();
  }
  core_.WakeWaitersUnlocked();
  return absl::OkStatus();
}

bool Requester::TakeAcks(Link& link, absl::Status* error) {
  const absl::StatusOr<size_t> got = link.in->TryFill();
  if (!got.ok()) {
    *error = got.status();
    return false;
  }
  DataHeader h;
  while (link.in->Buffered() >= sizeof h) {
    std::memcpy(&h, link.in->Peek(), sizeof h);
    // What the reader would do with it (OnAnswer): a run of WRITEs landed.
    if (h.type != kWriteAck || h.status != 0) return false;
    link.in->Drop(sizeof h);
    ++core_.waiter_acks;
    link.inputs.store(link.inputs.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    *error = OnWriteAcks(link, h);
    if (!error->ok()) return false;
  }
  return true;
}

absl::Status Requester::OnAnswer(Link& link, const DataHeader& h) {
  if (h.type == kWriteAck && h.status == 0) return OnWriteAcks(link, h);
  WorkRequest wr;
  {
    MutexLock lock(&core_.mu);
    const WorkRequest* found = link.outstanding.Find(h.id);
    if (found == nullptr) {
      return absl::DataLossError(absl::StrCat("answer for unknown request ", h.id));
    }
    wr = *found;
  }
  if (h.status != 0) {
    std::string text(std::min(h.text_len, kMaxErrorText), '\0');
    RETURN_IF_ERROR(ReadStream(*link.in, text.data(), text.size()));
    MutexLock lock(&core_.mu);
    if ((h.flags & kViaRef) != 0) return ResendStaged(link, wr, h.id, text);
    core_.FailLink(link, absl::Status(static_cast<absl::StatusCode>(h.status), text), h.id);
    return absl::OkStatus();
  }
  if (h.length != wr.length) {
    return absl::DataLossError("READ answer of the wrong length");
  }
  if ((h.flags & kViaRef) != 0) {  // the peer copied into our memory itself
    Completed(link, h.id, wr);
    return absl::OkStatus();
  }
  // Straight into the caller's buffer, which stays registered until
  // completion; device memory through the staging buffer.
  // (Without a CUDA driver no region is device memory: no lookup.)
  const int device = cuda::Driver::Get() != nullptr ? core_.regions.DeviceOf(wr.local_region) : -1;
  RETURN_IF_ERROR(device >= 0 ? link.recv_stage.Recv(*link.in, wr.local_addr, h.length, device)
                              : ReadStream(*link.in, wr.local_addr, h.length));
  Completed(link, h.id, wr);
  return absl::OkStatus();
}

void Requester::Completed(Link& link, uint64_t id, const WorkRequest& wr) {
  {
    MutexLock lock(&core_.mu);
    // Failed or closed meanwhile: already completed.
    if (!link.outstanding.Erase(id)) return;
    core_.Complete(wr, absl::OkStatus());
    core_.NotifyLocked();
  }
  core_.WakeWaitersUnlocked();
}

absl::Status Requester::ResendStaged(Link& link, const WorkRequest& wr, uint64_t id,
                                     const std::string& why) {
  if (link.share.ok) {
    KVF_LOG(WARNING) << "tcp: link " << link.id << ": the peer cannot open this process's "
                     << "shared memory (" << why << "); its bytes go over the socket";
  }
  link.share.ok = false;
  if (link.stopping) return absl::OkStatus();
  Job job;
  job.header.type = wr.opcode == Opcode::kWrite ? kWriteReq : kReadReq;
  job.header.flags = kAckNow;
  job.header.id = id;
  job.header.remote_addr = wr.remote_addr;
  job.header.rkey = wr.remote_key;
  job.header.length = wr.length;
  if (wr.opcode == Opcode::kWrite) {
    job.data = wr.local_addr;
    job.device = core_.regions.DeviceOf(wr.local_region);
  }
  if (link.jobs.empty()) link.jobs_from = 0;
  link.jobs.push_back(std::move(job));
  link.cv.SignalAll();
  return absl::OkStatus();
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
