#include "handshake/tcp_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "base/thread.h"
#include "handshake/tcp_server_state.h"
#include "net/event_loop.h"

namespace kvferry {
namespace handshake {

using server_internal::kReadChunk;
using server_internal::kSweepEvery;

void TcpServer::State::Admit(net::Fd fd) {
  ++accepted;
  if (conns.size() >= options.max_connections) EvictQuietest();
  (void)net::SetNoDelay(fd.get());
  const uint64_t id = ++last_conn;
  auto c = std::make_unique<Conn>();
  c->fd = std::move(fd);
  c->last_active = absl::Now();
  net::SocketAddress peer;
  peer.length = sizeof peer.storage;
  if (::getpeername(c->fd.get(), reinterpret_cast<sockaddr*>(&peer.storage), &peer.length) == 0) {
    const std::string text = peer.ToString();
    c->source = text.substr(0, text.rfind(':'));
  }
  const int raw = c->fd.get();
  if (!loop->Watch(raw, EPOLLIN | EPOLLRDHUP, [this, id](uint32_t e) { OnEvent(id, e); }).ok()) {
    return;  // closes the fd
  }
  conns.emplace(id, std::move(c));
  ++open;
}

void TcpServer::State::EvictQuietest() {
  uint64_t victim = 0;
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [id, c] : conns) {
    if (!c->busy && c->last_active < oldest) {
      oldest = c->last_active;
      victim = id;
    }
  }
  if (victim == 0) return;
  ++evicted;
  Warn(absl::StrCat("at the cap of ", options.max_connections,
                    " connections: closing the one quiet longest"));
  Close(victim);
}

void TcpServer::State::OnEvent(uint64_t id, uint32_t events) {
  auto it = conns.find(id);
  if (it == conns.end()) return;
  Conn* c = it->second.get();
  if (events & EPOLLOUT) {
    if (!Flush(id, c)) return;
    if (c->out.empty()) Dispatch(id, c);  // requests that came while it waited
    it = conns.find(id);
    if (it == conns.end()) return;
    c = it->second.get();
  }
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
    if (c->busy || !c->out.empty()) {
      // Not reading now (one request at a time). A hang-up is reported
      // whatever the mask, so stop watching (no spinning); the reply, when
      // it comes, fails to send and closes the connection.
      if (events & (EPOLLHUP | EPOLLERR)) {
        c->closing = true;
        loop->Unwatch(c->fd.get());
      }
      return;
    }
    if (!ReadSome(id, c)) return;
    Dispatch(id, c);
  }
}

// Reads what is there. False when the connection was closed.
bool TcpServer::State::ReadSome(uint64_t id, Conn* c) {
  char buf[kReadChunk];
  for (;;) {
    const ssize_t n = ::read(c->fd.get(), buf, sizeof buf);
    if (n > 0) {
      if (c->in.empty()) c->first_byte = absl::Now();
      c->in.append(buf, n);
      buffered += n;
      if (c->large) large_buffered += n;
      c->last_active = absl::Now();
      if (!Classify(id, c) || !WithinBudget(id, c)) return false;
      if (static_cast<size_t>(n) < sizeof buf) return true;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    Close(id);  // closed by the peer, or reset
    return false;
  }
}

// Answers the complete requests that have arrived, one at a time: on this
// thread when the handler will not wait, else through the handler pool.
void TcpServer::State::Dispatch(uint64_t id, Conn* c) {
  // At most this many answered in a row, then other connections' turn.
  constexpr int kInlineBurst = 16;
  int answered = 0;
  // Replies of pipelined requests go out together: c->out holds those not
  // yet written while `deferred`.
  bool deferred = false;
  while (!c->busy && (c->out.empty() || deferred) && c->in.size() >= kFrameHeaderBytes) {
    absl::StatusOr<FrameHeader> h = Header(c->in);
    if (!h.ok()) {
      Refuse(id, c, h.status());  // after the replies deferred so far
      return;
    }
    const size_t total = kFrameHeaderBytes + h->payload_bytes;
    if (c->in.size() < total) break;
    Frame request{h->type, c->in.substr(kFrameHeaderBytes, h->payload_bytes)};
    const bool inline_answer = options.may_block && !options.may_block(request);
    if (!inline_answer && deferred) {
      // The handler pool's turn once what is deferred is out.
      if (!Flush(id, c)) return;
      deferred = false;
      continue;
    }
    Unclassify(c);
    c->in.erase(0, total);
    buffered -= total;
    c->first_byte = c->in.empty() ? absl::InfiniteFuture() : absl::Now();
    if (!Classify(id, c)) return;  // a pipelined large one over its source's share
    if (inline_answer) {
      handshake::Answer answer = [&] {
        RequestSourceScope from(c->source);
        return handler(request);
      }();
      // The next request is in whole: its reply goes with this one.
      const bool more = answer.take == nullptr && answered + 1 < kInlineBurst && WholeRequestIn(*c);
      if (!Answer(id, c, answer.reply, std::move(answer.take), /*flush=*/!more)) return;
      deferred = more;
      if (++answered == kInlineBurst) {
        loop->Post([this, id] {
          auto it = conns.find(id);
          if (it != conns.end()) Dispatch(id, it->second.get());
        });
        return;
      }
      continue;  // a pipelined request may be waiting
    }
    c->busy = true;
    (void)loop->Modify(c->fd.get(), 0);
    MutexLock lock(&mu);
    jobs.push_back(Job{id, std::move(request), c->source});
    cv.Signal();
  }
  if (deferred) (void)Flush(id, c);
}

bool TcpServer::State::WholeRequestIn(const Conn& c) const {
  if (c.in.size() < kFrameHeaderBytes) return false;
  absl::StatusOr<FrameHeader> h = Header(c.in);
  return h.ok() && c.in.size() >= kFrameHeaderBytes + h->payload_bytes;
}

void TcpServer::State::OnReply(uint64_t id, Frame reply, TakeConnection take) {
  auto it = conns.find(id);
  if (it == conns.end()) return;
  Conn* c = it->second.get();
  c->busy = false;
  if (Answer(id, c, reply, std::move(take))) Dispatch(id, c);
}

// SendReply, and the connection handed to `take` once the reply is out
// (when set). False when the connection was closed or handed over.
bool TcpServer::State::Answer(uint64_t id, Conn* c, const Frame& reply, TakeConnection take,
                              bool flush) {
  if (take != nullptr && !c->in.empty()) {
    // The requester did not wait for the reply: what follows is neither
    // the handshake's nor, yet, the new owner's.
    Refuse(id, c,
           absl::InvalidArgumentError("bytes after a request that hands the connection over"));
    return false;
  }
  c->take = std::move(take);
  return SendReply(id, c, reply, flush);
}

// The connection leaves the server for its new owner.
void TcpServer::State::HandOver(uint64_t id, Conn* c) {
  TakeConnection take = std::move(c->take);
  loop->Unwatch(c->fd.get());
  net::Fd fd = std::move(c->fd);
  Unclassify(c);
  buffered -= c->in.size();
  conns.erase(id);
  --open;
  ++handed_over;
  take(std::move(fd));
}

// Queues `reply` behind any deferred ones and, with `flush`, starts writing
// them. False when the connection was closed or handed over.
bool TcpServer::State::SendReply(uint64_t id, Conn* c, const Frame& reply, bool flush) {
  const std::string frame = EncodeFrame(reply.type, reply.payload);
  c->out += frame;  // after replies deferred, if any (Dispatch)
  buffered += frame.size();
  c->last_active = absl::Now();
  return !flush || Flush(id, c);
}

// Writes what it can of the reply. False when the connection was closed.
bool TcpServer::State::Flush(uint64_t id, Conn* c) {
  while (c->out_done < c->out.size()) {
    const ssize_t n =
        ::send(c->fd.get(), c->out.data() + c->out_done, c->out.size() - c->out_done, MSG_NOSIGNAL);
    if (n > 0) {
      c->out_done += n;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      (void)loop->Modify(c->fd.get(), EPOLLOUT);
      return true;
    }
    if (n < 0 && errno == EINTR) continue;
    Close(id);
    return false;
  }
  buffered -= c->out.size();
  c->out.clear();
  c->out_done = 0;
  c->last_active = absl::Now();
  if (c->closing) {
    Close(id);
    return false;
  }
  if (c->take != nullptr) {
    HandOver(id, c);
    return false;
  }
  (void)loop->Modify(c->fd.get(), EPOLLIN | EPOLLRDHUP);
  return true;
}

// Tells the peer why (best effort) and closes once that is written.
void TcpServer::State::Refuse(uint64_t id, Conn* c, const absl::Status& why) {
  ++refused;
  Warn(absl::StrCat("closing a connection: ", why.ToString()));
  Unclassify(c);
  buffered -= c->in.size();
  c->in.clear();
  c->closing = true;
  OnReply(id, ErrorFrame(why), nullptr);
}

void TcpServer::State::Close(uint64_t id) {
  auto it = conns.find(id);
  if (it == conns.end()) return;
  Conn* c = it->second.get();
  Unclassify(c);
  buffered -= c->in.size() + (c->out.size());
  loop->Unwatch(c->fd.get());
  conns.erase(it);
  --open;
}

void TcpServer::State::Sweep() {
  const absl::Time now = absl::Now();
  std::vector<uint64_t> doomed;
  for (const auto& [id, c] : conns) {
    if (c->busy) continue;
    const bool slow_request = now - c->first_byte > options.request_timeout;
    const bool slow_reader = !c->out.empty() && now - c->last_active > options.request_timeout;
    const bool idle =
        c->in.empty() && c->out.empty() && now - c->last_active > options.idle_timeout;
    if (slow_request || slow_reader || idle) doomed.push_back(id);
  }
  for (uint64_t id : doomed) {
    ++reaped;
    Close(id);
  }
  sweep_timer = loop->After(kSweepEvery, [this] { Sweep(); });
}

void TcpServer::State::Worker() {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu);
      while (!stopping && jobs.empty()) cv.Wait(&mu);
      if (stopping) return;
      job = std::move(jobs.front());
      jobs.pop_front();
    }
    handshake::Answer answer = [&] {
      RequestSourceScope from(job.source);
      return handler(job.request);
    }();
    const uint64_t id = job.conn;
    loop->Post([this, id, a = std::move(answer)]() mutable {
      OnReply(id, std::move(a.reply), std::move(a.take));
    });
  }
}

TcpServer::TcpServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<TcpServer>> TcpServer::Start(net::ListeningSocket socket,
                                                            std::string address,
                                                            HandingHandler handler,
                                                            TcpServerOptions options) {
  auto s = std::make_unique<State>();
  s->socket = std::move(socket);
  s->address = std::move(address);
  s->handler = std::move(handler);
  s->options = options;
  absl::StatusOr<std::unique_ptr<net::EventLoop>> loop =
      net::EventLoop::Start(absl::StrCat("handshake ", s->address));
  if (!loop.ok()) return loop.status();
  s->loop = std::move(*loop);
  std::unique_ptr<TcpServer> server(new TcpServer(std::move(s)));
  State* st = server->state_.get();
  for (int i = 0; i < std::max(1, options.handler_threads); ++i) {
    absl::StatusOr<std::thread> t = StartThread("a handshake handler", [st] { st->Worker(); });
    if (!t.ok()) return t.status();  // ~TcpServer stops those started
    st->workers.push_back(std::move(*t));
  }
  absl::Status watched;
  st->loop->Run([&] {
    watched = net::ServeListener(
        st->loop.get(), st->socket.fd.get(), [st](net::Fd fd) { st->Admit(std::move(fd)); },
        [st](int error) {
          ++st->pauses;
          st->Warn(
              absl::StrCat("cannot accept (", std::strerror(error), "); pausing the listener"));
        });
    st->sweep_timer = st->loop->After(kSweepEvery, [st] { st->Sweep(); });
  });
  if (!watched.ok()) return watched;
  return server;
}

TcpServer::~TcpServer() {
  State* st = state_.get();
  if (st->loop) {
    st->loop->Run([st] {
      st->loop->Cancel(st->sweep_timer);
      st->loop->Unwatch(st->socket.fd.get());
      while (!st->conns.empty()) st->Close(st->conns.begin()->first);
    });
  }
  {
    MutexLock lock(&st->mu);
    st->stopping = true;
    st->cv.SignalAll();
  }
  for (auto& t : st->workers) t.join();
  st->loop.reset();  // runs what the workers posted (they find no connection)
}

std::string TcpServer::address() const { return state_->address; }

std::vector<std::pair<std::string, uint64_t>> TcpServer::RefusedInput() const {
  const TcpServerStats s = stats();
  return {{"handshake_connection_evicted", s.evicted},
          {"handshake_frame_refused", s.refused_frames},
          {"handshake_connection_reaped", s.reaped},
          {"handshake_connection_shed", s.shed},
          {"handshake_accept_paused", s.accept_pauses}};
}

TcpServerStats TcpServer::stats() const {
  TcpServerStats s;
  s.accepted = state_->accepted;
  s.open = state_->open;
  s.evicted = state_->evicted;
  s.refused_frames = state_->refused;
  s.reaped = state_->reaped;
  s.accept_pauses = state_->pauses;
  s.handed_over = state_->handed_over;
  s.shed = state_->shed;
  return s;
}

}  // namespace handshake
}  // namespace kvferry
