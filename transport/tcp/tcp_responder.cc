// The TCP transport, responder side: checking and executing a peer's
// requests (those by reference through the host share) and queueing their
// answers.
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::Status Responder::ServeByReference(Link& link, const DataHeader& h, const ShareRef& ref,
                                         char* target, int device, Job* answer, bool* unserved) {
  const absl::Status copied =
      core_.refs.Copy(link.share, h.flags, ref, h.type == kWriteReq, target, device, h.length);
  if (copied.ok() || copied.code() == absl::StatusCode::kInvalidArgument) {
    return copied;  // a bad reference is refused like a range out of bounds
  }
  *unserved = true;
  answer->header.flags = kViaRef;
  answer->header.status = static_cast<uint8_t>(absl::StatusCode::kUnimplemented);
  answer->text = std::string(copied.message().substr(0, kMaxErrorText));
  return absl::OkStatus();
}

Job Responder::Execute(Link& link, const DataHeader& h, absl::Status* stream_error) {
  const bool write = h.type == kWriteReq;
  Job answer;
  answer.header.type = write ? kWriteAck : kReadResp;
  answer.header.id = h.id;
  ShareRef ref;
  const bool via_ref = (h.flags & kViaRef) != 0;
  if (via_ref) {
    *stream_error = ReadStream(*link.in, &ref, sizeof ref);
    if (!stream_error->ok()) return answer;
  }
  absl::Status refused;
  // Every request, zero-length ones too, names a key this end gave out and
  // a range inside its region.
  {
    char* target = nullptr;
    int device = -1;
    // No lock is held while the bytes cross the network: the region stays
    // registered through the reader's held use (UnregisterMemory waits for
    // it), kept for the next request into the same region.
    refused = core_.regions.UseRemoteHeld(h, write, link.fd.get(), &link.held, &target, &device);
    if (h.length == 0) {
      // Nothing to move.
    } else if (refused.ok() && via_ref) {
      bool unserved = false;
      refused = ServeByReference(link, h, ref, target, device, &answer, &unserved);
      if (unserved) return answer;
    } else if (refused.ok() && write) {
      // Straight into a host region: no intermediate buffer.
      *stream_error = device >= 0 ? link.recv_stage.Recv(*link.in, target, h.length, device)
                                  : ReadStream(*link.in, target, h.length);
    }
  }
  if (!refused.ok()) {
    ++core_.refused_requests;
    if (write && !via_ref) *stream_error = link.in->Skip(h.length);
    answer.header.status = static_cast<uint8_t>(refused.code());
    answer.text = std::string(refused.message().substr(0, kMaxErrorText));
    answer.close_after = true;  // like an RC responder entering the error state
    return answer;
  }
  if (!write && via_ref) {
    answer.header.flags = kViaRef;  // copied already: no bytes follow
    answer.header.length = h.length;
  } else if (!write) {
    answer.read_answer = true;
    answer.header.remote_addr = h.remote_addr;
    answer.header.rkey = h.rkey;
    answer.header.length = h.length;
  }
  return answer;
}

absl::Status Responder::QueueAnswer(Link& link, Job job, uint64_t covered) {
  // A plain answer goes from the reader itself when the writer is idle,
  // without blocking (a rest goes to the writer): when no request waits
  // behind it (nothing more received), or when it acknowledges a run of
  // kInlineAckMinBytes or more (measured, issue 38: the responder's
  // context switches per request halved at 4 KiB and quartered at 16 KiB,
  // docs/performance.md "Fewer hand-offs").
  // Not for runs over kInlineAckMaxBytes with more received behind them.
  // Otherwise the writer thread sends it: a READ answer's data is better
  // copied into the socket there while the reader goes on.
  const bool plain = !job.read_answer && job.text.empty() && !job.close_after && !job.by_ref &&
                     job.device < 0 &&
                     (link.in->Buffered() == 0 ||
                      (covered >= kInlineAckMinBytes && covered <= kInlineAckMaxBytes));
  bool to_writer = false;
  absl::Status queued;
  {
    MutexLock lock(&core_.mu);
    if (link.stopping) return absl::CancelledError("the link is closing");
    to_writer = !plain || !link.jobs.empty() || link.writer_busy || link.inline_rest;
    if (to_writer) {
      queued = QueueAnswerLocked(link, std::move(job));
    } else {
      link.writer_busy = true;
      link.inline_jobs.clear();
      link.inline_jobs.push_back(std::move(job));
      link.inline_sent = 0;
    }
  }
  if (!to_writer) {
    core_.SendInline(link);
  } else if (queued.ok()) {
    // Woken once the lock is released, as Requester::Post wakes it: a
    // writer woken under the lock woke only to sleep on the mutex, and the
    // reader's unlock then woke it again (docs/performance.md, "The writer
    // woken after the lock").
    link.cv.SignalAll();
  }
  return queued;
}

absl::Status Responder::QueueAnswerLocked(Link& link, Job job) {
  // A peer keeps at most its max_outstanding_per_link requests unanswered,
  // so a legitimate one never has more answers waiting here than that
  // (plus what the writer is sending). One that sends on without reading
  // its answers would grow this queue without bound: it loses the link.
  if (++link.queued_answers > kAnswerQueueFactor * core_.options.max_outstanding_per_link) {
    ++core_.dropped_readers;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the peer sent more than ", kAnswerQueueFactor * core_.options.max_outstanding_per_link,
        " requests without reading their answers"));
  }
  if (link.jobs.empty()) link.jobs_from = 0;  // not a Post's
  link.jobs.push_back(std::move(job));
  return absl::OkStatus();
}

absl::Status Responder::FlushRun(Link& link, AckRun& run) {
  if (run.job.header.remote_addr == 0) return absl::OkStatus();
  return QueueAnswer(link, std::exchange(run.job, Job{}), std::exchange(run.bytes, 0));
}

absl::Status Responder::Serve(Link& link, const DataHeader& h, AckRun& run, bool* refusing) {
  if (*refusing) {
    // After refusing a request the link closes once that answer is out
    // (like an RC responder in the error state): requests behind it are
    // read off the stream and never executed, so none of them lands after
    // the requester saw it flushed.
    if ((h.flags & kViaRef) != 0) {
      ShareRef skipped;
      return ReadStream(*link.in, &skipped, sizeof skipped);
    }
    return h.type == kWriteReq ? link.in->Skip(h.length) : absl::OkStatus();
  }
  absl::Status stream;
  Job answer = Execute(link, h, &stream);
  RETURN_IF_ERROR(stream);
  *refusing = answer.close_after;
  if (h.type != kWriteReq || answer.header.status != 0) {
    RETURN_IF_ERROR(FlushRun(link, run));
    return QueueAnswer(link, std::move(answer));
  }
  // Acknowledged in runs up to the end of the requester's Post: one answer
  // (and one wake-up at the requester) for many WRITEs.
  if (run.job.header.remote_addr == 0) {
    run.job.header.type = kWriteAck;
    run.job.header.id = h.id;
  }
  ++run.job.header.remote_addr;
  run.bytes += h.length;
  const bool more = run.job.header.remote_addr < kMaxAckRun && run.bytes < kMaxAckRunBytes &&
                    (h.flags & kAckNow) == 0;
  return more ? absl::OkStatus() : FlushRun(link, run);
}

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry
