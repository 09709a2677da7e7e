// One TCP link's state, and the state the TCP transport's units share
// (LinkCore): its options, regions, links and completions, and the one lock
// over the links and completions. The units (tcp_transport_internal.h):
//   TcpTransport  the Transport: lifecycle, links made and closed, polling;
//   Requester     this end's requests: Post, and the answers that come back;
//   Responder     the peer's requests: executed, and their answers queued;
//   LinkThreads   each link's reader and writer threads.
// Internal to transport/tcp.
#ifndef KVFERRY_TRANSPORT_TCP_LINK_H_
#define KVFERRY_TRANSPORT_TCP_LINK_H_

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/thread_cache.h"
#include "net/socket.h"
#include "transport/checks.h"
#include "transport/completion_queue.h"
#include "transport/id_window.h"
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

constexpr uint32_t kMaxErrorText = 1024;
// The writer sends up to this many queued messages with one sendmsg.
constexpr size_t kMaxJobsPerSend = 64;

// Something for a link's writer to send.
struct Job {
  DataHeader header;
  const void* data = nullptr;  // request data (WRITE) from a pinned local buffer
  std::string text;            // error text of a refused request
  bool read_answer = false;    // send region bytes, re-checked under the lock
  bool close_after = false;    // the responder refused: close the connection
  int device = -1;             // data lies on this CUDA device: sent through a staging buffer
  bool by_ref = false;         // header.flags has kViaRef: `ref` follows the header
  ShareRef ref;
};
struct Link {
  using State = LinkState;  // transport/checks.h
  LinkId id = 0;
  std::atomic<uint64_t> inputs{0};  // messages read from the peer (the reader counts)
  // The peer's in-process key when it lives in this process (shortcut).
  uint64_t peer_key = 0;
  // This end's gate (with the shortcut on), and the peer end's, through
  // which this end's shortcut copies go (null: the peer's link was gone
  // when this one was made, so its requests go over the socket).
  std::shared_ptr<DirectGate> gate;
  std::shared_ptr<DirectGate> peer_gate;
  uint32_t direct_busy = 0;   // shortcut copies running on this link
  uint32_t idle_waiters = 0;  // threads in WaitLinkIdle
  net::Fd fd;
  State state = State::kPending;
  uint64_t token = 0;
  IdWindow<WorkRequest> outstanding;  // by request id, handed out in sequence
  std::vector<Job> jobs;              // the writer takes them all at once
  uint64_t jobs_from = 0;             // the Post whose jobs started `jobs`
  // Sent by the posting thread while the writer was idle (writer_busy is
  // set meanwhile). What the socket
  // did not take at once (inline_rest) the writer sends first, from byte
  // inline_sent on.
  std::vector<Job> inline_jobs;
  size_t inline_sent = 0;
  bool inline_rest = false;
  bool stopping = false;
  bool writer_busy = false;
  bool passive = false;  // made by AcceptLink
  // A passive link's connection is being attached (Attach): its fd and
  // threads are set outside the lock, and StopAndJoin waits for that.
  bool attaching = false;
  bool reader_done = false;     // the reader thread has returned
  uint32_t queued_answers = 0;  // answers in `jobs` (reader and writer, under mu_)
  CondVar cv;                   // jobs arrived / stopping / writer idle
  ThreadCache::Task reader;
  ThreadCache::Task writer;
  // Pinned host buffers for device memory, made on first use: the
  // writer's (sending) and the reader's (receiving), each used by its own
  // thread only.
  Staging send_stage;
  Staging recv_stage;
  // What the reader thread receives comes through here (made with fd).
  std::unique_ptr<StreamReader> in;
  // The region the reader's last request of the peer used, kept while
  // requests follow (RegionTable::Held); the reader's only.
  RegionTable::Held held;
  // Same-host sharing (ref_carrier.h); its imports are closed when the
  // reader ends.
  LinkShare share;
  // The reader's turn, handed to waiters (under LinkCore::mu). Once the
  // reader has delivered acknowledgements to a thread waiting in
  // WaitCompletions, it sets `park`: with nothing buffered, it then waits
  // on reader_cv (listed in LinkCore::parked meanwhile) instead of in
  // recv, and the next waiter reads the link's acknowledgements itself
  // (`waiter_reading`, one at a time): one thread woken per batch, not
  // two. Anything else on the link (a request of the peer, an error
  // answer, a READ's data, the connection's end) gives the turn back
  // (`park` cleared, the reader signalled). So does a slice of kParkSlice
  // in which no waiter read (`read_in_turn` unset): a link nobody waits on
  // is read by its reader within that time. `handed_error`: what a waiter
  // read that fails the link; the reader fails it.
  bool park = false;
  bool waiter_reading = false;
  bool read_in_turn = false;
  // The last run acknowledged on the link was small (kSpinMaxRunBytes): a
  // waiter reading it polls kSpinPolls times before it sleeps.
  bool spin = false;
  absl::Status handed_error;
  CondVar reader_cv;
};

// WRITEs executed and not yet acknowledged: one kWriteAck for the run
// (header.remote_addr counts them). Requests on a link have consecutive
// ids and any other request flushes the run first, so a run is always
// consecutive.
struct AckRun {
  Job job;
  uint64_t bytes = 0;
};

// A request on a link whose peer is in this process (shortcut.h).
struct Direct {
  Direct(std::shared_ptr<Link> on, uint64_t id, const WorkRequest& wr, int local_device)
      : link(std::move(on)), rid(id) {
    copy.link = link.get();
    copy.gate = link->peer_gate.get();
    copy.peer_key = link->peer_key;
    copy.wr = wr;
    copy.local_device = local_device;
  }
  std::shared_ptr<Link> link;
  uint64_t rid = 0;
  Shortcuts::Copy copy;
};

// What the transport's units share. One lock (mu) covers every link's
// fields and the completions; the region table has its own, taken after mu
// where both are held.
class LinkCore {
 public:
  explicit LinkCore(TcpTransportOptions opts)
      : options(std::move(opts)), refs(options.host_share, options.same_host_only, options.kind) {}

  // Queues a completion; the caller wakes waiters (WakeWaiters) once.
  void Complete(const WorkRequest& wr, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cq.Push(wr, std::move(status));
  }
  // Wakes threads in WaitCompletions and calls the notifier, once per run
  // of completions.
  void WakeWaiters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cq_cv.SignalAll();
    WakePollers();
    if (notify) notify();
  }
  // The same in two halves, for the reader's answers and the in-process
  // copies (the common paths):
  // the notifier under the lock, and the waiters woken once it is
  // released, so that a woken waiter does not find it still held and
  // sleep again on the mutex (measured, issue 38: most of the initiator's
  // futex calls at 16 KiB were such wake-ups of the mutex).
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (notify) notify();
  }
  void WakeWaitersUnlocked() ABSL_LOCKS_EXCLUDED(mu) {
    cq_cv.SignalAll();
    WakePollers();
  }
  // Wakes a waiter that reads parked links (Link::park) in poll(), if any.
  void WakePollers() {
    if (pollers.load() == 0) return;
    const uint64_t one = 1;
    (void)!::write(wake_fd.get(), &one, sizeof one);
  }
  // The link enters the error state: request `first_id` completes with
  // `first`, the rest outstanding are flushed.
  void FailLink(Link& link, absl::Status first, uint64_t first_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Waits until no shortcut copy or send uses the link's requests.
  void WaitLinkIdle(Link& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++link.idle_waiters;
    while (link.writer_busy || link.direct_busy > 0) link.cv.Wait(&mu);
    --link.idle_waiters;
  }
  // An offered link's connection, once connected (ConnectOffered,
  // AdoptConnection). kCancelled when the link was closed meanwhile.
  absl::Status Install(LinkId id, net::Fd fd) ABSL_LOCKS_EXCLUDED(mu);
  // Sends a claimed link's inline_jobs (writer_busy set by the claimer)
  // without blocking; a rest goes to the writer. Clears writer_busy.
  void SendInline(Link& link) ABSL_LOCKS_EXCLUDED(mu);

  const TcpTransportOptions options;
  const RefCarrier refs;  // references of options.host_share
  RegionTable regions;
  uint64_t key = 0;                           // in-process key (shortcut.h), 0 without the shortcut
  std::atomic<uint64_t> refused_requests{0};  // out of bounds, bad key, no right
  std::atomic<uint64_t> dropped_readers{0};   // peers that read none of their answers

  Mutex mu;
  CondVar cq_cv;
  bool interrupted ABSL_GUARDED_BY(mu) = false;  // see InterruptWait
  absl::flat_hash_map<LinkId, std::shared_ptr<Link>> links ABSL_GUARDED_BY(mu);
  CompletionQueue cq ABSL_GUARDED_BY(mu);
  // Links whose reader is parked (Link::park), and the threads sleeping in
  // WaitCompletions on cq_cv.
  std::vector<std::shared_ptr<Link>> parked ABSL_GUARDED_BY(mu);
  uint32_t cq_waiters ABSL_GUARDED_BY(mu) = 0;
  // Waiters in poll() on parked links (raised under mu, read without it),
  // and the eventfd that wakes them for anything else that completes
  // (invalid: waiters never read links).
  std::atomic<uint32_t> pollers{0};
  net::Fd wake_fd;
  std::atomic<uint64_t> waiter_turns{0};  // TcpWaiterReads
  std::atomic<uint64_t> waiter_acks{0};
  std::atomic<uint64_t> turns_given_back{0};
  std::atomic<uint64_t> spin_waits{0};
  std::function<void()> notify ABSL_GUARDED_BY(mu);  // SetCompletionNotifier
};

}  // namespace tcp_internal
}  // namespace transport
}  // namespace kvferry

#endif  // KVFERRY_TRANSPORT_TCP_LINK_H_
