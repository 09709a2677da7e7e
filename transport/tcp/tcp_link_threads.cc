// The TCP transport: each link's writer thread (requests and answers out,
// several per sendmsg) and reader thread (requests served, answers taken).
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

void LinkThreads::WriterLoop(std::shared_ptr<Link> link) {
  std::vector<Job> jobs;  // swapped with the link's queue: no allocation once warm
  std::vector<Job> rest;  // the part of an inline send the socket did not take
  for (;;) {
    jobs.clear();
    rest.clear();
    size_t skip = 0;
    {
      MutexLock lock(&core_.mu);
      while (((link->jobs.empty() && !link->inline_rest) || link->writer_busy) && !link->stopping) {
        link->cv.Wait(&core_.mu);
      }
      if (link->stopping) return;
      if (link->inline_rest) {
        rest.swap(link->inline_jobs);
        skip = link->inline_sent;
        link->inline_rest = false;
      }
      jobs.swap(link->jobs);  // everything queued
      link->queued_answers = 0;
      link->writer_busy = true;
    }
    bool close_after = false;
    absl::Status sent;
    if (!rest.empty()) sent = SendJobs(*link, absl::MakeSpan(rest), &close_after, skip);
    // Up to kMaxJobsPerSend messages per sendmsg.
    for (size_t i = 0; i < jobs.size() && sent.ok() && !close_after; i += kMaxJobsPerSend) {
      sent = SendJobs(*link,
                      absl::MakeSpan(jobs).subspan(i, std::min(kMaxJobsPerSend, jobs.size() - i)),
                      &close_after);
    }
    {
      MutexLock lock(&core_.mu);
      link->writer_busy = false;
      link->cv.SignalAll();
    }
    if (!sent.ok() || close_after) {
      // The reader sees the connection end and fails the link.
      ::shutdown(link->fd.get(), sent.ok() ? SHUT_WR : SHUT_RDWR);
      return;
    }
  }
}

absl::Status LinkThreads::SendJobs(Link& link, absl::Span<Job> jobs, bool* close_after,
                                   size_t skip) {
  iovec iov[3 * kMaxJobsPerSend];
  int n = 0;
  // A READ answer sends region bytes: the region may have been unregistered
  // since the request was checked, so check again, and keep it registered
  // while its bytes go out (a RegionTable::Use; no lock is held while sending).
  std::vector<RegionTable::Use> uses;
  {
    for (Job& job : jobs) {
      if (job.read_answer) {
        char* source = nullptr;
        DataHeader request = job.header;
        request.type = kReadReq;
        absl::StatusOr<RegionTable::Use> use =
            core_.regions.UseRemote(request, /*write=*/false, link.fd.get(), &source, &job.device);
        if (!use.ok()) {
          job.header.status = static_cast<uint8_t>(use.status().code());
          job.header.length = 0;
          job.text = std::string(use.status().message().substr(0, kMaxErrorText));
          job.data = nullptr;
          job.read_answer = false;
          job.close_after = true;  // nothing after a refusal: the connection closes
        } else {
          job.data = source;
          uses.push_back(std::move(*use));
        }
      }
    }
  }
  {
    for (Job& job : jobs) {
      job.header.text_len = static_cast<uint32_t>(job.text.size());
      iov[n++] = {&job.header, sizeof job.header};
      if (!job.text.empty()) iov[n++] = {job.text.data(), job.text.size()};
      if (job.by_ref) iov[n++] = {&job.ref, sizeof job.ref};
      if (job.data != nullptr && job.header.length > 0 && job.device >= 0) {
        // Device memory: what is gathered goes first, then the bytes
        // through the staging buffer. (Never in an inline rest: skip
        // covers host jobs only.)
        iovec* first = iov;
        net::SkipBytes(first, n, skip);
        skip = 0;
        RETURN_IF_ERROR(SendAll(link.fd.get(), first, n));
        n = 0;
        RETURN_IF_ERROR(
            link.send_stage.Send(link.fd.get(), job.data, job.header.length, job.device));
      } else if (job.data != nullptr && job.header.length > 0) {
        iov[n++] = {const_cast<void*>(job.data), job.header.length};
      }
      if (job.close_after) {
        *close_after = job.close_after;
        break;  // nothing after a refusal: the connection closes
      }
    }
    iovec* first = iov;
    net::SkipBytes(first, n, skip);
    return SendAll(link.fd.get(), first, n);
  }
}

void LinkThreads::ReaderLoop(std::shared_ptr<Link> link) {
  link->in = std::make_unique<StreamReader>(link->fd.get());
  absl::Status error;
  AckRun run;
  bool refusing = false;
  while (error.ok()) {
    DataHeader h;
    if (link->in->Buffered() < sizeof h) {
      // About to wait for the peer: no region stays held meanwhile, and a
      // waiter may have the turn.
      link->held.Release();
      error = AwaitTurn(link);
      if (!error.ok()) break;
    }
    error = ReadStream(*link->in, &h, sizeof h);
    if (!error.ok()) break;
    // Only this thread writes it: a plain store, no locked add per message.
    link->inputs.store(link->inputs.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    // Reading ahead pays while payloads are small; a large one would be
    // copied out of the buffer: then only the next header is read ahead.
    const bool payload = (h.type == kWriteReq || h.type == kReadResp) && (h.flags & kViaRef) == 0;
    link->in->ReadAhead(payload && h.length >= StreamReader::kDirect ? sizeof h
                                                                     : StreamReader::kCapacity);
    if (h.type == kWriteReq || h.type == kReadReq) {
      error = responder_.Serve(*link, h, run, &refusing);
    } else if (h.type == kWriteAck || h.type == kReadResp) {
      error = requester_.OnAnswer(*link, h);
    } else {
      error = absl::DataLossError(absl::StrCat("unknown message type ", h.type));
    }
  }
  link->held.Release();
  link->share.imports.reset();
  MutexLock lock(&core_.mu);
  link->reader_done = true;
  // Closed here (CloseLink, destruction) or already failed: nothing to do.
  if (link->stopping) return;
  core_.FailLink(*link,
                 absl::UnavailableError(absl::StrCat("connection to peer lost on link ", link->id,
                                                     ": ", error.message())),
                 link->outstanding.empty() ? 0 : link->outstanding.first());
}

absl::Status LinkThreads::AwaitTurn(const std::shared_ptr<Link>& link) {
  MutexLock lock(&core_.mu);
  if (!link->park || link->stopping) return absl::OkStatus();
  core_.parked.push_back(link);
  if (core_.cq_waiters > 0) core_.cq_cv.SignalAll();  // one may read it now
  while ((link->park || link->waiter_reading) && !link->stopping) {
    link->read_in_turn = false;
    const bool timed_out = link->reader_cv.WaitWithTimeout(&core_.mu, kParkSlice);
    if (timed_out && !link->waiter_reading && !link->read_in_turn) link->park = false;
  }
  link->park = false;
  auto& parked = core_.parked;
  parked.erase(std::find(parked.begin(), parked.end(), link));
  if (link->stopping) return absl::CancelledError("the link is closing");
  return std::exchange(link->handed_error, absl::OkStatus());
}

absl::Status LinkThreads::Start(const std::shared_ptr<Link>& link) {
  absl::StatusOr<ThreadCache::Task> reader = threads_.Run([this, link] { ReaderLoop(link); });
  absl::StatusOr<ThreadCache::Task> writer =
      reader.ok() ? threads_.Run([this, link] { WriterLoop(link); }) : reader;
  if (reader.ok()) link->reader = std::move(*reader);
  if (writer.ok()) {
    link->writer = std::move(*writer);
    return absl::OkStatus();
  }
  // Whatever started sees the link stopping and returns; the link fails.
  {
    MutexLock lock(&core_.mu);
    link->stopping = true;
    link->cv.SignalAll();
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  return writer.status();
}

absl::Status LinkThreads::Attach(const std::shared_ptr<Link>& link, absl::StatusOr<net::Fd> fd) {
  {
    MutexLock lock(&core_.mu);
    if (!fd.ok() || link->stopping) {
      // No reader will run: gone for its peer; what was posted on it fails.
      if (!fd.ok()) core_.FailLink(*link, fd.status(), 0);
      link->reader_done = true;
      return fd.ok() ? absl::CancelledError("the link was closed") : fd.status();
    }
    link->fd = std::move(*fd);
    link->attaching = true;
  }
  (void)net::SetNoDelay(link->fd.get());
  (void)net::SetKeepAlive(link->fd.get(), core_.options.dead_peer_timeout);
  absl::Status started = Start(link);
  MutexLock lock(&core_.mu);
  link->attaching = false;
  if (!started.ok()) {
    core_.FailLink(*link, started, 0);
    link->reader_done = true;
  }
  link->cv.SignalAll();
  return started;
}

void LinkThreads::StopAndJoin(const std::shared_ptr<Link>& link) {
  // A peer's shortcut copies through this link end before this returns.
  if (link->gate != nullptr) link->gate->Close(/*wait=*/true);
  {
    MutexLock lock(&core_.mu);
    link->stopping = true;
    link->cv.SignalAll();
    link->reader_cv.SignalAll();
    while (link->attaching) link->cv.Wait(&core_.mu);
  }
  ::shutdown(link->fd.get(), SHUT_RDWR);
  link->reader.Join();
  link->writer.Join();
}

void LinkThreads::ReapDeadPassive() {
  std::vector<std::shared_ptr<Link>> dead;
  {
    MutexLock lock(&core_.mu);
    for (auto it = core_.links.begin(); it != core_.links.end();) {
      const Link& l = *it->second;
      if (l.passive && l.reader_done && l.outstanding.empty()) {
        dead.push_back(it->second);
        core_.links.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& link : dead) StopAndJoin(link);
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
