// The TCP transport's units (their shared state: link.h), each in its file:
//   tcp_transport.cc     TcpTransport: lifecycle, links, completions;
//   tcp_regions.cc       TcpTransport: registering memory;
//   tcp_requester.cc     Requester: posting requests (the socket, inline
//                        from the posting thread, or copied in-process) and
//                        their answers;
//   tcp_responder.cc     Responder: executing a peer's requests and
//                        queueing answers;
//   tcp_link_threads.cc  LinkThreads: each link's writer and reader threads;
//   tcp_io.{h,cc}        socket I/O and the device-memory staging buffers.
// Internal to transport/tcp: users include tcp_transport.h.
#ifndef KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_
#define KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_

#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/errno_status.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/scratch.h"
#include "base/status_macros.h"
#include "base/thread_cache.h"
#include "cuda/driver.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/host_share.h"
#include "transport/id_window.h"
#include "transport/link_params.h"
#include "transport/stream_links.h"
#include "transport/tcp/hello_acceptor.h"
#include "transport/tcp/link.h"
#include "transport/tcp/ref_carrier.h"
#include "transport/tcp/region_table.h"
#include "transport/tcp/shortcut.h"
#include "transport/tcp/stream_reader.h"
#include "transport/tcp/tcp_io.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace transport {
namespace tcp_internal {

using tcp_wire::DataHeader;
using tcp_wire::DecodeLinkParams;
using tcp_wire::EncodeLinkParams;
using tcp_wire::kAckNow;
using tcp_wire::kReadReq;
using tcp_wire::kReadResp;
using tcp_wire::kRefSecondKind;
using tcp_wire::kViaRef;
using tcp_wire::kWriteAck;
using tcp_wire::kWriteReq;
using tcp_wire::PeerParams;

// A Post on an idle link of at most this many bytes of data (headers
// aside: 16 blocks of 64 KiB fit) is sent by the posting thread itself (no
// hand-off to the writer thread), without blocking: what the socket does
// not take at once goes to the writer. 64 KiB until the waiting thread read
// its own link (Link::park); with that, 256 KiB moved 16 KiB blocks faster
// (docs/performance.md, "The waiting thread reads its link"). 1 MiB, with
// runs of 64 KiB requests parking too, moved 16 blocks of 64 KiB at 0.91
// of the raw stream against 0.83 (docs/performance.md, "One thread for a
// Post of 64 KiB blocks; ..."). Larger Posts are copied by the writer while the
// posting thread goes on: a Submit costs its caller a bounded copy.
constexpr uint64_t kInlineSendBytes = 1 << 20;
// A responder acknowledges WRITEs in runs: up to the last request of each
// Post on the link (kAckNow), and at most this many requests or bytes.
constexpr uint64_t kMaxAckRun = 32;
constexpr uint64_t kMaxAckRunBytes = 1 << 20;
// The responder's reader sends a run's acknowledgement itself (the writer
// idle) when the run covers at least this many bytes, even with more
// requests received behind it: one small send per this much data at most,
// so a peer that reads slowly never gets a stream of tiny segments.
constexpr uint64_t kInlineAckMinBytes = 16 << 10;
// ... and at most this many: a larger run's answer, with more received
// behind it, goes to the writer. The thread that sends an answer wakes the
// requester's thread onto its own CPU (the kernel's wake-up on the same
// host); the reader, sending it, was preempted by it: 1 MiB blocks, 4.5
// preemptions of the reader a batch against 2.0, and 0.91-0.95 of the raw
// stream against 0.98-0.99 (docs/performance.md, "Who is woken, and where").
constexpr uint64_t kInlineAckMaxBytes = 256 << 10;
// A parked reader (Link::park) takes its link back after a slice of this
// long in which no waiter read it.
constexpr absl::Duration kParkSlice = absl::Milliseconds(1);
// A reader parks (Link::park) only after delivering a run whose requests
// average at most this many bytes. Runs of larger requests come few per
// byte: the hand-off saved is small, and a waiter woken by the peer's
// acknowledgement ran on the peer's CPU and preempted its reader twice as
// often (1 MiB blocks: 6.5 preemptions a batch against 3). Runs of 16
// blocks of 64 KiB park (docs/performance.md, "Who is woken, and where").
constexpr uint64_t kParkMaxRequestBytes = 256 << 10;
// A waiter reading parked links first polls them this many times without
// sleeping when the last run acknowledged on one of them was of at most
// kSpinMaxRunBytes: the next answer comes within tens of microseconds, and
// a thread that sleeps for it is woken and run later than that on this
// host's vCPUs. 2 KiB blocks 1.42 of the raw stream against 1.07, 4 KiB
// 1.14 against 0.91; polling after runs of 1 MiB (64 KiB blocks) cost
// 0.05, after runs of 256 KiB it made no difference (docs/performance.md,
// "One thread for a Post of 64 KiB blocks; the waiter polls before it
// sleeps").
constexpr int kSpinPolls = 32;
constexpr uint64_t kSpinMaxRunBytes = 64 << 10;
// A waiter reads at most this many parked links at once.
constexpr size_t kMaxPolled = 8;
// Answers a responder queues for one link before it drops a peer that does
// not read them, in units of max_outstanding_per_link.
constexpr uint32_t kAnswerQueueFactor = 2;

// The CPUs this process may run on (its affinity mask: taskset, cpusets).
uint32_t UsableCpus();

constexpr uint64_t kPreferredRequestBytes = 1 << 20;

// This end's requests: posted over the socket (sent by the posting thread
// while the link is idle, else by its writer) or copied in-process, and the
// answers the link's reader takes for them.
class Requester {
 public:
  explicit Requester(LinkCore& core) : core_(core) {}

  absl::Status Post(absl::Span<const WorkRequest> batch) ABSL_LOCKS_EXCLUDED(core_.mu);
  // An answer to one of this end's requests (the link's reader).
  absl::Status OnAnswer(Link& link, const DataHeader& h) ABSL_LOCKS_EXCLUDED(core_.mu);
  // A waiter's turn at a parked link (Link::park): takes what the socket
  // holds without blocking and delivers the acknowledgements at the front
  // of the stream. Returns false when the reader must take its turn back:
  // something else is next (left buffered for it), or `*error` fails the
  // link (the connection's end, a bad acknowledgement).
  bool TakeAcks(Link& link, absl::Status* error) ABSL_LOCKS_EXCLUDED(core_.mu);

 private:
  // Request `id` (`wr`) succeeded: completed, and the waiters woken after
  // the lock is released (nothing if it failed or closed meanwhile).
  void Completed(Link& link, uint64_t id, const WorkRequest& wr) ABSL_LOCKS_EXCLUDED(core_.mu);
  // Queues the batch: `direct` gets the requests copied in-process,
  // `inline_links` the links this thread sends on (ClaimInline), `wake`
  // those whose writer the caller wakes.
  absl::Status PostLocked(absl::Span<const WorkRequest> batch, std::vector<Direct>& direct,
                          std::vector<std::shared_ptr<Link>>& inline_links,
                          std::vector<std::shared_ptr<Link>>& wake) ABSL_LOCKS_EXCLUDED(core_.mu);
  // The link and local region of the request last looked up: a batch's
  // requests mostly share both, and neither changes while Post holds the
  // locks, so each is looked up once per run (measured, issue 38: a third
  // of the transport's instructions per 16 KiB request were lookups).
  struct Lookups {
    LinkId link_id = 0;
    Link* link = nullptr;
    RegionId region_id = 0;
    RegionTable::Entry* region = nullptr;
  };
  // Request `wr`'s link and local region into `seen` (looked up unless
  // they are the last ones); the link must take requests.
  absl::Status LookUpLocked(const WorkRequest& wr, Lookups& seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu) ABSL_SHARED_LOCKS_REQUIRED(core_.regions.mu()) {
    if (seen.link != nullptr && wr.link == seen.link_id && seen.region != nullptr &&
        wr.local_region == seen.region_id) {
      return absl::OkStatus();
    }
    return LookUpAgainLocked(wr, seen);
  }
  absl::Status LookUpAgainLocked(const WorkRequest& wr, Lookups& seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu) ABSL_SHARED_LOCKS_REQUIRED(core_.regions.mu());
  // LookUpLocked, and the local range must lie in the region.
  absl::Status ValidateLocked(const WorkRequest& wr, Lookups& seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu) ABSL_SHARED_LOCKS_REQUIRED(core_.regions.mu());
  // If `link` is idle (writer not busy, nothing queued before `post`),
  // claims it for the calling thread: its jobs move to inline_jobs.
  bool ClaimInline(Link& link, uint64_t post) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // Copies the bytes of each request (Shortcuts::CopyAll) and completes
  // it, taking each lock once for the lot.
  void RunDirect(std::vector<Direct>& direct) ABSL_LOCKS_EXCLUDED(core_.mu);
  absl::Status OnWriteAcks(Link& link, const DataHeader& h);  // a run of landed WRITEs
  // The peer could not serve request `id` by reference: send it again with
  // its bytes, and no more references on this link.
  absl::Status ResendStaged(Link& link, const WorkRequest& wr, uint64_t id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);

  LinkCore& core_;
  uint64_t last_post_ ABSL_GUARDED_BY(core_.mu) = 0;
};

// The peer's requests: checked against this end's regions, executed (the
// bytes straight between the socket and the region, or through the host
// share by reference), and answered; WRITEs are acknowledged in runs.
class Responder {
 public:
  explicit Responder(LinkCore& core) : core_(core) {}

  // The reader's part for one request of the peer: executes it (or, after
  // a refusal, reads it off the stream) and queues or gathers its answer.
  absl::Status Serve(Link& link, const DataHeader& h, AckRun& run, bool* refusing)
      ABSL_LOCKS_EXCLUDED(core_.mu);

 private:
  // Executes a peer's request; returns the answer to send.
  Job Execute(Link& link, const DataHeader& h, absl::Status* stream_error);
  // A request whose bytes are in the requester's memory (kViaRef), copied
  // by the host share into or out of `target` (on `device`): OK when
  // copied, the error that refuses it, or OK with *unserved when this end
  // cannot open the reference (`answer` then asks for the bytes).
  absl::Status ServeByReference(Link& link, const DataHeader& h, const ShareRef& ref, char* target,
                                int device, Job* answer, bool* unserved);
  // Hands an answer to the writer. kCancelled once the link is stopping.
  // `covered`: the bytes a WRITE run's acknowledgement answers for.
  absl::Status QueueAnswer(Link& link, Job job, uint64_t covered = 0) ABSL_LOCKS_EXCLUDED(core_.mu);
  // Queues it for the writer; the caller wakes the writer (link.cv) once
  // it has released the lock.
  absl::Status QueueAnswerLocked(Link& link, Job job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  absl::Status FlushRun(Link& link, AckRun& run);

  LinkCore& core_;
};

// Each link's two threads, run on warm threads of its own cache: the
// reader (requests to the Responder, answers to the Requester) and the
// writer (queued requests and answers, several per sendmsg).
class LinkThreads {
 public:
  LinkThreads(LinkCore& core, Requester& requester, Responder& responder)
      : core_(core), requester_(requester), responder_(responder) {}

  // Starts `count` threads now, for a new peer's first links.
  void Prestart(size_t count) { threads_.Prestart(count); }
  // Runs the link's reader and writer. On a refusal the link fails (its
  // connection is shut down) and the error returned.
  absl::Status Start(const std::shared_ptr<Link>& link) ABSL_LOCKS_EXCLUDED(core_.mu);
  // Gives passive `link` its connection and starts its threads; when the
  // connection never came (`fd` an error) or the link was closed meanwhile,
  // the link ends (reaped by the next AcceptLink).
  absl::Status Attach(const std::shared_ptr<Link>& link, absl::StatusOr<net::Fd> fd)
      ABSL_LOCKS_EXCLUDED(core_.mu);
  // Stops the link's threads and waits for them, and for the peer's
  // shortcut copies through it.
  void StopAndJoin(const std::shared_ptr<Link>& link) ABSL_LOCKS_EXCLUDED(core_.mu);
  // Closes accepted links whose connection has ended and which have nothing
  // outstanding: the peer that made them is gone or reconnected, and
  // nobody here holds their id (the engine never posts on them).
  void ReapDeadPassive() ABSL_LOCKS_EXCLUDED(core_.mu);

 private:
  void ReaderLoop(std::shared_ptr<Link> link);
  // Before the reader blocks: while the link is parked (Link::park), waits
  // for its turn back. The error a waiter handed back, or kCancelled when
  // the link stops.
  absl::Status AwaitTurn(const std::shared_ptr<Link>& link) ABSL_LOCKS_EXCLUDED(core_.mu);
  void WriterLoop(std::shared_ptr<Link> link);
  // Sends `jobs` with one sendmsg. Sets *close_after when the connection
  // must be closed after them (a refused request).
  // `skip`: bytes of them already sent.
  absl::Status SendJobs(Link& link, absl::Span<Job> jobs, bool* close_after, size_t skip = 0);

  LinkCore& core_;
  Requester& requester_;
  Responder& responder_;
  ThreadCache threads_{"tcp link", 16};
};

class TcpTransport final : public Transport, public StreamLinks {
 public:
  explicit TcpTransport(TcpTransportOptions options) : core_(std::move(options)) {}
  ~TcpTransport() override;

  absl::Status Start();

  EndpointDescription LocalEndpoint() const override;
  Limits GetLimits() const override {
    // Each request costs a header, its share of a system call, an answer and
    // a completion, so large requests are preferred; each link keeps two
    // threads busy at each end, so a host with few CPUs gets one link. The
    // measurements behind both: docs/performance.md, "TCP request size and
    // links".
    const TcpTransportOptions& o = core_.options;
    return Limits{
        o.max_outstanding_per_link, o.max_request_bytes,
        o.max_region_bytes,         std::min<uint64_t>(kPreferredRequestBytes, o.max_request_bytes),
        UsableCpus() < 4 ? 1u : 2u,
        /*accept_waits=*/false};
  }
  absl::StatusOr<Region> RegisterMemory(void* addr, uint64_t length, Access access) override;
  absl::Status UnregisterMemory(RegionId region) override { return core_.regions.Remove(region); }
  absl::StatusOr<LinkOffer> OfferLink(NicIndex local_nic) override;
  absl::Status ConnectOffered(LinkId link, const NicInfo& peer_nic) override;
  absl::Status AdoptConnection(LinkId link, net::Fd connection) override;
  absl::StatusOr<LinkOffer> CreateLink(NicIndex local_nic, const NicInfo& peer_nic) override;
  absl::StatusOr<LinkOffer> AcceptLink(NicIndex local_nic, const NicInfo& peer_nic,
                                       absl::string_view peer_params) override;
  absl::Status CompleteLink(LinkId link, absl::string_view peer_params) override;
  absl::Status CloseLink(LinkId link) override;
  bool HasLink(LinkId link) override;
  uint64_t InputCount(LinkId link) override;
  absl::Status Post(absl::Span<const WorkRequest> batch) override { return requester_.Post(batch); }
  size_t PollCompletions(absl::Span<Completion> out) override;
  size_t WaitCompletions(absl::Span<Completion> out, absl::Duration timeout) override;
  // Takes queued completions (none: no region lock taken).
  size_t PopLocked(absl::Span<Completion> out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  void InterruptWait() override;
  // A waiter's turn at the parked links (Link::park) until one of them
  // delivers or hands its turn back, something else wakes it, or
  // `deadline`. `links` holds the links it polled (the caller's, kept
  // over its turns and let go once the lock is released).
  void ReadParkedLocked(absl::Time deadline, std::shared_ptr<Link> (&links)[kMaxPolled])
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_.mu);
  // A parked link (in LinkCore::parked) a waiter may take a turn at: not
  // handed back, not stopping, and no other waiter reads it.
  static bool Claimable(const Link& link) {
    return link.park && !link.waiter_reading && !link.stopping;
  }
  void* QueryExtension(absl::string_view name) override {
    if (name == kSelf) return this;  // GetTcpWaiterReads
    return name == StreamLinks::kName ? static_cast<StreamLinks*>(this) : nullptr;
  }
  static constexpr absl::string_view kSelf = "kvferry.transport.tcp_internal";
  TcpWaiterReads waiter_reads() const {
    return {core_.waiter_turns.load(), core_.waiter_acks.load(), core_.turns_given_back.load(),
            core_.spin_waits.load()};
  }
  std::vector<std::pair<std::string, uint64_t>> RefusedInput() const override {
    const HelloAcceptorStats s = acceptor_->stats();
    return {{"data_connection_bad_hello", s.bad_hellos},
            {"data_connection_duplicate_token", s.duplicate_tokens},
            {"data_connection_evicted", s.evicted},
            {"data_connection_expired", s.expired},
            {"data_connection_never_came", s.claims_expired},
            {"data_claim_evicted", s.claims_evicted},
            {"data_accept_paused", s.accept_pauses},
            {"data_request_refused", core_.refused_requests.load()},
            {"data_peer_dropped_unread_answers", core_.dropped_readers.load()}};
  }
  bool SetCompletionNotifier(std::function<void()> notify) override {
    MutexLock lock(&core_.mu);
    core_.notify = std::move(notify);
    return true;
  }

 private:
  LinkCore core_;
  Requester requester_{core_};
  Responder responder_{core_};
  // Every link is stopped (the destructor) before this goes.
  LinkThreads threads_{core_, requester_, responder_};
  net::ListeningSocket listener_;
  std::string advertised_;
  std::unique_ptr<HelloAcceptor> acceptor_;
  LinkId last_link_ ABSL_GUARDED_BY(core_.mu) = 0;
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_TCP_TRANSPORT_INTERNAL_H_
