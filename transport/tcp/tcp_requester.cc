// The TCP transport, requester side: Post (over the socket, sent inline
// by the posting thread, or copied in-process), completions, link failure,
// and the answers that come back.
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::Status TcpTransport::ValidateLocked(const WorkRequest& wr) {
  auto link = links_.find(wr.link);
  RETURN_IF_ERROR(CheckLinkUsable(wr.link, link == links_.end() ? nullptr : &link->second->state));
  const RegionEntry* region = regions_.Find(wr.local_region);
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown local region ", wr.local_region));
  }
  return CheckLocal(wr, region->region, options_.max_request_bytes);
}

absl::Status TcpTransport::Post(absl::Span<const WorkRequest> batch) {
  // Requests to a peer in this process, copied after the locks are gone.
  Scratch<Direct> direct;
  // Links idle when this Post came: their requests go from this thread.
  Scratch<std::shared_ptr<Link>> inline_links;
  RETURN_IF_ERROR(PostLocked(batch, *direct, *inline_links));
  for (const std::shared_ptr<Link>& link : *inline_links) SendInline(*link);
  inline_links->clear();  // drop the references now, not at the next Post
  if (!direct->empty()) RunDirect(*direct);
  return absl::OkStatus();
}

absl::Status TcpTransport::PostLocked(absl::Span<const WorkRequest> batch,
                                      std::vector<Direct>& direct,
                                      std::vector<std::shared_ptr<Link>>& inline_links) {
  MutexLock lock(&mu_);
  ReaderMutexLock regions(&regions_.mu());
  for (const WorkRequest& wr : batch) RETURN_IF_ERROR(ValidateLocked(wr));
  RETURN_IF_ERROR(CheckLinkCapacity(
      batch,
      [this](LinkId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held by Post
        return links_.at(id)->outstanding.size();
      },
      options_.max_outstanding_per_link));
  const uint64_t post = ++last_post_;
  for (const WorkRequest& wr : batch) {
    Link& link = *links_.at(wr.link);
    RegionEntry& local = *regions_.Find(wr.local_region);  // validated above
    local.local_uses.fetch_add(1);
    const uint64_t rid = link.outstanding.Add(wr);
    if (link.peer_key != 0) {
      direct.emplace_back(links_.at(wr.link), rid, wr, local.device);
      continue;
    }
    Job job;
    job.header.type = wr.opcode == Opcode::kWrite ? kWriteReq : kReadReq;
    job.header.id = rid;
    job.header.remote_addr = wr.remote_addr;
    job.header.rkey = wr.remote_key;
    job.header.length = wr.length;
    const uint16_t by_ref = refs_.Name(
        link.share, local.share.get(),
        reinterpret_cast<uintptr_t>(wr.local_addr) - local.region.addr, wr.length, &job.ref);
    job.header.flags |= by_ref;
    job.by_ref = by_ref != 0;
    if (!job.by_ref && wr.opcode == Opcode::kWrite) {
      job.data = wr.local_addr;
      job.device = local.device;
    }
    if (link.jobs.empty()) link.jobs_from = post;
    link.jobs.push_back(std::move(job));
  }
  // Per link: its last request of this Post asks for the answer to the
  // run it ends, and one wake-up for the writer, not one per request.
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *links_.at(batch[i].link);
    if (link.peer_key != 0) continue;          // copied in Post, no message
    link.jobs.back().header.flags |= kAckNow;  // held lock: the back is this Post's
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (i > 0 && batch[i].link == batch[i - 1].link) continue;
    Link& link = *links_.at(batch[i].link);
    if (link.peer_key != 0 || link.jobs.empty()) continue;
    if (ClaimInline(link, post)) {
      inline_links.push_back(links_.at(batch[i].link));
    } else {
      link.cv.SignalAll();
    }
  }
  return absl::OkStatus();
}

bool TcpTransport::ClaimInline(Link& link, uint64_t post) {
  // (A passive link whose connection has not arrived yet keeps its jobs
  // queued: its writer sends them once it is attached.)
  if (!link.fd.valid() || link.writer_busy || link.inline_rest || link.stopping ||
      link.jobs_from != post || link.jobs.size() > kMaxJobsPerSend) {
    return false;
  }
  uint64_t bytes = 0;
  for (const Job& job : link.jobs) {
    if (job.device >= 0 || job.by_ref) return false;  // staged, or a reference: the writer
    bytes += sizeof job.header + (job.data ? job.header.length : 0);
  }
  // Small Posts only: a large one is better copied into the socket by the
  // writer thread while this thread goes on (measured: 64 x 4 KiB per Post
  // ran at 0.50-0.54 of a raw stream sent from here, 0.63-0.66 handed off).
  if (bytes > kInlineSendBytes) return false;
  link.writer_busy = true;
  link.inline_jobs.swap(link.jobs);  // link.jobs is empty (and keeps its capacity)
  link.inline_sent = 0;
  return true;
}

void TcpTransport::SendInline(Link& link) {
  iovec iov[2 * kMaxJobsPerSend];
  int n = 0;
  size_t total = 0;
  for (Job& job : link.inline_jobs) {  // requests and plain answers: no READ data, no text
    iov[n++] = {&job.header, sizeof job.header};
    total += sizeof job.header;
    if (job.data != nullptr && job.header.length > 0) {
      iov[n++] = {const_cast<void*>(job.data), job.header.length};
      total += job.header.length;
    }
  }
  size_t sent = 0;
  const absl::Status st = SendIov(link.fd.get(), iov, n, /*wait=*/false, &sent);
  MutexLock lock(&mu_);
  link.writer_busy = false;
  if (!st.ok()) {
    link.inline_jobs.clear();
    ::shutdown(link.fd.get(), SHUT_RDWR);  // the reader sees it and fails the link
  } else if (sent < total) {
    link.inline_sent = sent;  // the writer sends the rest first
    link.inline_rest = true;
  } else {
    link.inline_jobs.clear();
  }
  link.cv.SignalAll();  // the writer (rest, jobs queued meanwhile) and idle waiters
}

void TcpTransport::RunDirect(std::vector<Direct>& direct) {
  {
    MutexLock lock(&mu_);
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
  MutexLock lock(&mu_);
  bool completed = false;
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
      FailLink(link, std::move(d.copy.status), d.rid);
    } else if (link.outstanding.Erase(d.rid)) {
      CompleteLocked(d.copy.wr, absl::OkStatus());
      completed = true;
    }
  }
  if (completed) WakeWaiters();
}

void TcpTransport::CompleteLocked(const WorkRequest& wr, absl::Status status) {
  cq_.Push(wr, std::move(status));
}

void TcpTransport::WakeWaiters() {
  cq_cv_.SignalAll();
  if (notify_) notify_();
}

void TcpTransport::FailLink(Link& link, absl::Status first, uint64_t first_id) {
  if (link.state == Link::State::kError) return;
  link.state = Link::State::kError;
  link.stopping = true;
  if (link.gate != nullptr) link.gate->Close(/*wait=*/false);  // StopAndJoin waits
  link.jobs.clear();
  link.cv.SignalAll();
  ::shutdown(link.fd.get(), SHUT_RDWR);
  // The writer may be sending from a request buffer: wait until it is not,
  // so no buffer is read after its request has been completed.
  WaitLinkIdle(link);
  const std::string reason(first.message());
  if (link.outstanding.Find(first_id) == nullptr && !link.outstanding.empty()) {
    first_id = link.outstanding.first();
  }
  if (const WorkRequest* wr = link.outstanding.Find(first_id)) {
    CompleteLocked(*wr, std::move(first));
    link.outstanding.Erase(first_id);
  }
  link.outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    CompleteLocked(wr, absl::AbortedError(
                           absl::StrCat("flushed: link ", link.id, " failed earlier: ", reason)));
  });
  link.outstanding.Clear();
  WakeWaiters();
}

absl::Status TcpTransport::OnWriteAcks(Link& link, const DataHeader& h) {
  // A run of WRITEs, all landed: requests [h.id, + h.remote_addr).
  if (h.remote_addr == 0 || h.remote_addr > options_.max_outstanding_per_link) {
    return absl::DataLossError(absl::StrCat("WRITE ack for ", h.remote_addr, " requests"));
  }
  MutexLock lock(&mu_);
  for (uint64_t id = h.id; id < h.id + h.remote_addr; ++id) {
    const WorkRequest* wr = link.outstanding.Find(id);
    if (wr == nullptr) {
      if (link.stopping) break;  // closed or failed here meanwhile
      return absl::DataLossError(absl::StrCat("answer for unknown request ", id));
    }
    CompleteLocked(*wr, absl::OkStatus());
    link.outstanding.Erase(id);
  }
  WakeWaiters();
  return absl::OkStatus();
}

absl::Status TcpTransport::OnAnswer(Link& link, const DataHeader& h) {
  if (h.type == kWriteAck && h.status == 0) return OnWriteAcks(link, h);
  WorkRequest wr;
  {
    MutexLock lock(&mu_);
    const WorkRequest* found = link.outstanding.Find(h.id);
    if (found == nullptr) {
      return absl::DataLossError(absl::StrCat("answer for unknown request ", h.id));
    }
    wr = *found;
  }
  if (h.status != 0) {
    std::string text(std::min(h.text_len, kMaxErrorText), '\0');
    RETURN_IF_ERROR(ReadStream(*link.in, text.data(), text.size()));
    MutexLock lock(&mu_);
    if ((h.flags & kViaRef) != 0) return ResendStaged(link, wr, h.id, text);
    FailLink(link, absl::Status(static_cast<absl::StatusCode>(h.status), text), h.id);
    return absl::OkStatus();
  }
  if (h.length != wr.length) {
    return absl::DataLossError("READ answer of the wrong length");
  }
  if ((h.flags & kViaRef) != 0) {  // the peer copied into our memory itself
    MutexLock lock(&mu_);
    if (link.outstanding.Erase(h.id)) {
      CompleteLocked(wr, absl::OkStatus());
      WakeWaiters();
    }
    return absl::OkStatus();
  }
  // Straight into the caller's buffer, which stays registered until
  // completion; device memory through the staging buffer.
  // (Without a CUDA driver no region is device memory: no lookup.)
  const int device = cuda::Driver::Get() != nullptr ? regions_.DeviceOf(wr.local_region) : -1;
  RETURN_IF_ERROR(device >= 0 ? link.recv_stage.Recv(*link.in, wr.local_addr, h.length, device)
                              : ReadStream(*link.in, wr.local_addr, h.length));
  MutexLock lock(&mu_);
  if (link.outstanding.Erase(h.id)) {
    CompleteLocked(wr, absl::OkStatus());
    WakeWaiters();
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::ResendStaged(Link& link, const WorkRequest& wr, uint64_t id,
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
    job.device = regions_.DeviceOf(wr.local_region);
  }
  if (link.jobs.empty()) link.jobs_from = 0;
  link.jobs.push_back(std::move(job));
  link.cv.SignalAll();
  return absl::OkStatus();
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
