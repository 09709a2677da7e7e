#include "sim/fabric.h"

#include <algorithm>
#include <utility>

namespace kvferry {
namespace sim {

Fabric::Fabric(Scheduler* scheduler, uint64_t seed, FaultOptions faults)
    : scheduler_(scheduler), prng_(seed), faults_(faults), topology_(scheduler) {}

Fabric::Port& Fabric::PortOf(NicId nic) {
  if (nic >= ports_.size()) ports_.resize(topology_.nic_count());
  return ports_[nic];
}

void Fabric::Attach(NicId nic, Receiver receiver) { PortOf(nic).receiver = std::move(receiver); }

void Fabric::Detach(NicId nic) {
  if (topology_.HasNic(nic)) PortOf(nic).receiver = nullptr;
}

SimTime Fabric::SerializationTime(uint64_t bytes, uint64_t bits_per_sec) {
  unsigned __int128 bits = static_cast<unsigned __int128>(bytes) * 8;
  unsigned __int128 ns = (bits * 1'000'000'000 + bits_per_sec - 1) / bits_per_sec;
  return static_cast<SimTime>(ns);
}

bool Fabric::DropsPacketOf(uint64_t wire_bytes, uint32_t mtu) {
  if (faults_.drop.num == 0) return false;
  const uint64_t packets = std::max<uint64_t>(1, (wire_bytes + mtu - 1) / mtu);
  // Draw for every packet so the number of draws depends only on the size.
  bool dropped = false;
  for (uint64_t i = 0; i < packets; ++i) dropped |= prng_.Chance(faults_.drop);
  return dropped;
}

SimTime Fabric::Send(NicId from, NicId to, uint64_t wire_bytes, std::string bytes) {
  Port& src = PortOf(from);
  Port& dst = PortOf(to);
  const NicSpec& src_spec = topology_.nic_spec(from);
  const NicSpec& dst_spec = topology_.nic_spec(to);
  const SimTime now = scheduler_->now();
  const SimTime tx_start = std::max(now, src.tx_free);
  const SimTime tx_end = tx_start + SerializationTime(wire_bytes, src_spec.bits_per_sec);
  ++stats_.sent;
  scheduler_->Trace(PairKey(from, to) ^ wire_bytes);
  if (!topology_.PathOpen(from, to)) {
    ++stats_.dropped;
    return tx_end;  // nothing leaves a dead path; the time is nominal
  }
  src.tx_free = tx_end;
  SimTime path = ToSimTime(src_spec.latency + dst_spec.latency);
  if (prng_.Chance(faults_.delay)) {
    path += prng_.UniformIn(0, ToSimTime(faults_.max_delay));
  }
  const uint32_t mtu = std::min(src_spec.mtu, dst_spec.mtu);
  if (DropsPacketOf(wire_bytes, mtu)) {
    ++stats_.dropped;
    scheduler_->Trace(uint64_t{0xd0});
    return tx_end;
  }
  const SimTime held = std::max<SimTime>(0, src.held_until - tx_start);  // HoldNic
  const SimTime rx_start = std::max(tx_start + held + path, dst.rx_free);
  const SimTime arrival = std::max(rx_start + SerializationTime(wire_bytes, dst_spec.bits_per_sec),
                                   tx_end + held + path);
  dst.rx_free = arrival;
  Message msg{from, to, std::move(bytes)};
  scheduler_->At(arrival, [this, m = std::move(msg)]() mutable { Deliver(std::move(m)); });
  return tx_end;
}

void Fabric::HoldNic(NicId nic, absl::Duration d) {
  Port& port = PortOf(nic);
  port.held_until = std::max(port.held_until, scheduler_->now() + ToSimTime(d));
}

void Fabric::Deliver(Message&& msg) {
  Port& dst = PortOf(msg.to);
  // Checked again at arrival: whatever went down meanwhile loses the message.
  if (!topology_.PathOpen(msg.from, msg.to) || !dst.receiver) {
    ++stats_.dropped;
    scheduler_->Trace(uint64_t{0xd1});
    return;
  }
  ++stats_.delivered;
  stats_.bytes_delivered += msg.bytes.size();
  // Copy the receiver: it may detach itself (or others) while running.
  Receiver receiver = dst.receiver;
  receiver(std::move(msg));
}

}  // namespace sim
}  // namespace kvferry
