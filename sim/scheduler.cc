#include "sim/scheduler.h"

#include <utility>

namespace kvferry {
namespace sim {
namespace {

// A 64-bit mixing step (the SplitMix64 finaliser over the running hash).
uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

absl::Time Scheduler::Now() const {
  return absl::UnixEpoch() + absl::Nanoseconds(now_);
}

void Scheduler::SleepFor(absl::Duration d) { RunUntil(now_ + ToSimTime(d)); }

void Scheduler::After(SimTime delay, EventFn fn, OwnerId owner) {
  At(now_ + (delay > 0 ? delay : 0), std::move(fn), owner);
}

void Scheduler::At(SimTime time, EventFn fn, OwnerId owner) {
  queue_.push(Event{time < now_ ? now_ : time, next_seq_++, owner,
                    std::move(fn)});
}

void Scheduler::CancelOwner(OwnerId owner) {
  if (owner != 0) cancelled_owners_.insert(owner);
}

void Scheduler::DropCancelledTop() {
  while (!queue_.empty() && queue_.top().owner != 0 &&
         cancelled_owners_.contains(queue_.top().owner)) {
    queue_.pop();
  }
}

bool Scheduler::idle() {
  DropCancelledTop();
  return queue_.empty();
}

bool Scheduler::Step() {
  DropCancelledTop();
  if (queue_.empty()) return false;
  // priority_queue::top is const; the event is moved out before pop.
  Event ev = std::move(const_cast<Event&>(queue_.top()));
  queue_.pop();
  now_ = ev.time;
  ++events_run_;
  trace_hash_ = Mix(Mix(trace_hash_, static_cast<uint64_t>(ev.time)), ev.seq);
  ev.fn();
  return true;
}

bool Scheduler::NextDueBy(SimTime time) {
  DropCancelledTop();
  return !queue_.empty() && queue_.top().time <= time;
}

void Scheduler::RunUntil(SimTime time) {
  while (NextDueBy(time)) Step();
  if (time > now_) now_ = time;
}

bool Scheduler::RunUntilCondition(const std::function<bool()>& done,
                                  SimTime deadline) {
  while (!done()) {
    if (!NextDueBy(deadline)) {
      if (deadline > now_) now_ = deadline;
      return done();
    }
    Step();
  }
  return true;
}

uint64_t Scheduler::RunUntilIdle(uint64_t max_events) {
  uint64_t ran = 0;
  while (ran < max_events && Step()) ++ran;
  return ran;
}

void Scheduler::Trace(uint64_t value) { trace_hash_ = Mix(trace_hash_, value); }

void Scheduler::Trace(absl::string_view text) {
  uint64_t word = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    word = (word << 8) | static_cast<unsigned char>(text[i]);
    if (i % 8 == 7) trace_hash_ = Mix(trace_hash_, word);
  }
  trace_hash_ = Mix(trace_hash_, word);
}

}  // namespace sim
}  // namespace kvferry
