// The TCP transport, responder side: checking and executing a peer's
// requests (CUDA IPC imports included) and queueing their answers.
#include "transport/tcp/tcp_transport_internal.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

absl::Status TcpTransport::CheckRemote(const DataHeader& h, bool write, char** target,
                                       int* device) {
  auto it = by_key_.find(h.rkey);
  if (it == by_key_.end()) return UnknownKeyError(h.rkey);
  RETURN_IF_ERROR(CheckRemoteAccess(it->second->region, write ? Opcode::kWrite : Opcode::kRead,
                                    h.remote_addr, h.length));
  *target = reinterpret_cast<char*>(h.remote_addr);
  if (device != nullptr) *device = it->second->device;
  return absl::OkStatus();
}

absl::Status TcpTransport::ServeViaIpc(Link& link, const DataHeader& h, const IpcRef& ipc,
                                       char* target, int device, Job* answer, bool* unserved) {
  const bool write = h.type == kWriteReq;
  absl::StatusOr<char*> theirs = ImportIpc(link, ipc, (h.flags & kViaVmm) != 0, h.length, device);
  if (theirs.status().code() == absl::StatusCode::kInvalidArgument) {
    return theirs.status();  // a bad request: refused like one out of bounds
  }
  if (!theirs.ok()) {
    // Not served here: the requester sends it again, staged.
    *unserved = true;
    answer->header.flags = kViaIpc;
    answer->header.status = static_cast<uint8_t>(absl::StatusCode::kUnimplemented);
    answer->text = std::string(theirs.status().message().substr(0, kMaxErrorText));
    return absl::OkStatus();
  }
  // Device to device on the GPUs (NVLink or PCIe); the CPU copies nothing.
  return cuda::Driver::Get()->Copy(write ? target : *theirs, write ? *theirs : target, h.length,
                                   device >= 0 ? device : 0);
}

TcpTransport::Job TcpTransport::Execute(Link& link, const DataHeader& h,
                                        absl::Status* stream_error) {
  const bool write = h.type == kWriteReq;
  Job answer;
  answer.header.type = write ? kWriteAck : kReadResp;
  answer.header.id = h.id;
  IpcRef ipc;
  const bool via_ipc = (h.flags & kViaIpc) != 0;
  if (via_ipc) {
    *stream_error = ReadStream(*link.in, &ipc, sizeof ipc);
    if (!stream_error->ok()) return answer;
  }
  absl::Status refused;
  // Every request, zero-length ones too, names a key this end gave out and
  // a range inside its region.
  {
    char* target = nullptr;
    int device = -1;
    // No lock is held while the bytes cross the network: the region stays
    // registered through `use` (UnregisterMemory waits for it).
    absl::StatusOr<RegionUse> use = UseRemote(h, write, link.fd.get(), &target, &device);
    refused = use.status();
    if (h.length == 0) {
      // Nothing to move.
    } else if (refused.ok() && via_ipc) {
      bool unserved = false;
      refused = ServeViaIpc(link, h, ipc, target, device, &answer, &unserved);
      if (unserved) return answer;
    } else if (refused.ok() && write) {
      // Straight into a host region: no intermediate buffer.
      *stream_error = device >= 0 ? link.recv_stage.Recv(*link.in, target, h.length, device)
                                  : ReadStream(*link.in, target, h.length);
    }
  }
  if (!refused.ok()) {
    ++refused_requests_;
    if (write && !via_ipc) *stream_error = link.in->Skip(h.length);
    answer.header.status = static_cast<uint8_t>(refused.code());
    answer.text = std::string(refused.message().substr(0, kMaxErrorText));
    answer.close_after = true;  // like an RC responder entering the error state
    return answer;
  }
  if (!write && via_ipc) {
    answer.header.flags = kViaIpc;  // copied already: no bytes follow
    answer.header.length = h.length;
  } else if (!write) {
    answer.read_answer = true;
    answer.header.remote_addr = h.remote_addr;
    answer.header.rkey = h.rkey;
    answer.header.length = h.length;
  }
  return answer;
}

void TcpTransport::CloseImport(const Link::Import& imp) {
  if (imp.vmm.base != nullptr) {
    UnmapVmm(imp.vmm);
  } else {
    cuda::Driver::Get()->IpcClose(imp.mapped, imp.ordinal);
  }
}

absl::StatusOr<char*> TcpTransport::ImportIpc(Link& link, const IpcRef& ref, bool vmm,
                                              uint64_t length, int device) {
  // Only a peer on this host, over a link that agreed to CUDA IPC, sends
  // references; anything else is served the ordinary way (the requester
  // sends it again, staged), never opened here.
  if (!link.same_host || cuda::Driver::Get() == nullptr) {
    return absl::UnavailableError(
        "this end takes no CUDA IPC references on this link (not the same host, or no CUDA "
        "driver)");
  }
  std::string key(ref.handle.reserved, vmm ? sizeof(uint64_t) : sizeof ref.handle.reserved);
  if (vmm) key.insert(0, "vmm:");
  auto it = link.ipc_imports.find(key);
  if (it == link.ipc_imports.end()) {
    // Opened through this end's device when the target is device memory,
    // else through device 0 (any context maps it).
    const int ordinal = device >= 0 ? device : 0;
    Link::Import imp{};
    imp.ordinal = ordinal;
    if (vmm) {
      if (link.peer_vmm == 0) return absl::UnavailableError("the peer has no VMM server");
      uint64_t id;
      std::memcpy(&id, ref.handle.reserved, sizeof id);
      ASSIGN_OR_RETURN(imp.vmm, FetchVmm(link.peer_vmm, id, ordinal));
      imp.mapped = imp.vmm.start;
      imp.size = imp.vmm.length;
    } else {
      ASSIGN_OR_RETURN(imp.mapped, cuda::Driver::Get()->IpcOpen(ref.handle, ordinal, &imp.size));
    }
    if (link.ipc_imports.size() >= std::max<size_t>(options_.max_ipc_imports, 1)) {
      // The least recently used makes room (the reader is the only user).
      auto lru = std::min_element(
          link.ipc_imports.begin(), link.ipc_imports.end(),
          [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
      CloseImport(lru->second);
      link.ipc_imports.erase(lru);
    }
    it = link.ipc_imports.emplace(key, imp).first;
  }
  it->second.used = ++link.imports_used;
  const Link::Import& imp = it->second;
  if (ref.offset > imp.size || length > imp.size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat("IPC reference [", ref.offset, ", +", length,
                                                   ") outside its allocation of ", imp.size,
                                                   " bytes"));
  }
  return static_cast<char*>(imp.mapped) + ref.offset;
}

absl::Status TcpTransport::QueueAnswer(Link& link, Job job) {
  // Sent by the writer thread while requests keep coming: the reader is the
  // responder's busy thread, and answering from it measured slower than
  // handing off. When no request waits behind this one (nothing more
  // received) and the writer is idle, the reader sends a plain answer
  // itself, without blocking (a rest goes to the writer): one thread
  // hand-off less for a lone request.
  const bool lone = link.in->Buffered() == 0 && !job.read_answer && job.text.empty() &&
                    !job.close_after && !job.ipc && job.device < 0;
  {
    MutexLock lock(&mu_);
    if (link.stopping) return absl::CancelledError("the link is closing");
    if (!lone || !link.jobs.empty() || link.writer_busy || link.inline_rest) {
      return QueueAnswerLocked(link, std::move(job));
    }
    link.writer_busy = true;
    link.inline_jobs.clear();
    link.inline_jobs.push_back(std::move(job));
    link.inline_sent = 0;
  }
  SendInline(link);
  return absl::OkStatus();
}

absl::Status TcpTransport::QueueAnswerLocked(Link& link, Job job) {
  // A peer keeps at most its max_outstanding_per_link requests unanswered,
  // so a legitimate one never has more answers waiting here than that
  // (plus what the writer is sending). One that sends on without reading
  // its answers would grow this queue without bound: it loses the link.
  if (++link.queued_answers > kAnswerQueueFactor * options_.max_outstanding_per_link) {
    ++dropped_readers_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the peer sent more than ", kAnswerQueueFactor * options_.max_outstanding_per_link,
        " requests without reading their answers"));
  }
  if (link.jobs.empty()) link.jobs_from = 0;  // not a Post's
  link.jobs.push_back(std::move(job));
  link.cv.SignalAll();
  return absl::OkStatus();
}

absl::Status TcpTransport::FlushRun(Link& link, AckRun& run) {
  if (run.job.header.remote_addr == 0) return absl::OkStatus();
  run.bytes = 0;
  return QueueAnswer(link, std::exchange(run.job, Job{}));
}

absl::Status TcpTransport::Serve(Link& link, const DataHeader& h, AckRun& run, bool* refusing) {
  if (*refusing) {
    // After refusing a request the link closes once that answer is out
    // (like an RC responder in the error state): requests behind it are
    // read off the stream and never executed, so none of them lands after
    // the requester saw it flushed.
    if ((h.flags & kViaIpc) != 0) {
      IpcRef skipped;
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
