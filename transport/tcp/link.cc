// The state the TCP transport's units share (link.h): a link's failure
// and its inline sends.
#include "transport/tcp/link.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include "absl/strings/str_cat.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

void LinkCore::FailLink(Link& link, absl::Status first, uint64_t first_id) {
  if (link.state == Link::State::kError) return;
  link.state = Link::State::kError;
  link.stopping = true;
  if (link.gate != nullptr) link.gate->Close(/*wait=*/false);  // StopAndJoin waits
  link.jobs.clear();
  link.cv.SignalAll();
  link.reader_cv.SignalAll();  // a parked reader ends
  ::shutdown(link.fd.get(), SHUT_RDWR);
  // The writer may be sending from a request buffer: wait until it is not,
  // so no buffer is read after its request has been completed.
  WaitLinkIdle(link);
  const std::string reason(first.message());
  if (link.outstanding.Find(first_id) == nullptr && !link.outstanding.empty()) {
    first_id = link.outstanding.first();
  }
  if (const WorkRequest* wr = link.outstanding.Find(first_id)) {
    Complete(*wr, std::move(first));
    link.outstanding.Erase(first_id);
  }
  link.outstanding.ForEach([&](uint64_t, const WorkRequest& wr) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    Complete(wr, absl::AbortedError(
                     absl::StrCat("flushed: link ", link.id, " failed earlier: ", reason)));
  });
  link.outstanding.Clear();
  WakeWaiters();
}

absl::Status LinkCore::Install(LinkId id, net::Fd fd) {
  MutexLock lock(&mu);
  auto it = links.find(id);
  if (it == links.end() || it->second->stopping || it->second->fd.valid()) {
    return absl::CancelledError(absl::StrCat("link ", id, " was closed meanwhile"));
  }
  it->second->fd = std::move(fd);
  return absl::OkStatus();
}

void LinkCore::SendInline(Link& link) {
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
  bool wake;
  {
    MutexLock lock(&mu);
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
    // The writer only when it has something to send (a rest, jobs queued
    // meanwhile): waking it for nothing cost a context switch per inline
    // send.
    wake = link.inline_rest || !link.jobs.empty() || link.idle_waiters > 0;
  }
  // After the lock, as every hand-off to the writer (Requester::Post).
  if (wake) link.cv.SignalAll();
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
