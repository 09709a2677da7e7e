#include "engine/metrics/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace kvferry {

namespace {

// The buckets' upper bounds in nanoseconds. Record runs for every request
// (under the pipeline's lock): whole nanoseconds and a short scan from the
// smallest bucket, where most requests fall, cost a few instructions, where
// a conversion to floating-point seconds (an Abseil division) and a binary
// search cost a tenth of a 64-request batch.
constexpr int64_t kBoundsNs[] = {10'000,        25'000,        50'000,        100'000,
                                 250'000,       500'000,       1'000'000,     2'500'000,
                                 5'000'000,     10'000'000,    25'000'000,    50'000'000,
                                 100'000'000,   250'000'000,   500'000'000,   1'000'000'000,
                                 2'500'000'000, 5'000'000'000, 10'000'000'000};
constexpr size_t kBuckets = sizeof kBoundsNs / sizeof kBoundsNs[0];

}  // namespace

const std::vector<double>& LatencyHistogram::Bounds() {
  static const std::vector<double> bounds = [] {
    std::vector<double> b;
    for (int64_t ns : kBoundsNs) b.push_back(static_cast<double>(ns) / 1e9);
    return b;
  }();
  return bounds;
}

size_t LatencyHistogram::BucketOf(int64_t ns) {
  size_t i = 0;
  while (i < kBuckets && ns > kBoundsNs[i]) ++i;  // the first bound >= ns
  return i;
}

void LatencyHistogram::Record(absl::Duration d) {
  const int64_t ns = absl::ToInt64Nanoseconds(d);  // saturates: +Inf lands last
  RecordNs(ns, BucketOf(ns));
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (size_t i = 0; i < buckets_.size(); ++i) buckets_[i] += other.buckets_[i];
  count_ += other.count_;
  sum_seconds_ += other.sum_seconds_;
}

void AddCounts(const PeerMetrics& from, PeerMetrics* into) {
  into->requests += from.requests;
  into->requests_ok += from.requests_ok;
  into->bytes_written += from.bytes_written;
  into->bytes_read += from.bytes_read;
  into->slices += from.slices;
  for (const auto& [code, n] : from.errors) into->errors[code] += n;
  into->latency.Merge(from.latency);
}

std::vector<uint64_t> LatencyHistogram::Cumulative() const {
  std::vector<uint64_t> out(buckets_.size());
  uint64_t running = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) out[i] = running += buckets_[i];
  return out;
}

double LatencyHistogram::QuantileBound(double q) const {
  if (count_ == 0) return 0;
  const std::vector<uint64_t> c = Cumulative();
  const double want = q * static_cast<double>(count_);
  for (size_t i = 0; i < Bounds().size(); ++i) {
    if (static_cast<double>(c[i]) >= want) return Bounds()[i];
  }
  return 1e300;
}

namespace {

std::string Escape(const std::string& v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

class Writer {
 public:
  Writer(std::string* out, std::string engine) : out_(out), engine_(std::move(engine)) {}
  void Family(const char* name, const char* type, const char* help) {
    absl::StrAppend(out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  // `labels`: extra labels already formatted as `k="v",...` (may be empty).
  void Sample(const std::string& name, const std::string& labels, double value) {
    absl::StrAppend(out_, name, "{engine=\"", Escape(engine_), "\"", labels.empty() ? "" : ",",
                    labels, "} ", absl::StrFormat("%.17g", value), "\n");
  }

 private:
  std::string* out_;
  std::string engine_;
};

std::string Label(const char* key, const std::string& value) {
  return absl::StrCat(key, "=\"", Escape(value), "\"");
}

}  // namespace

namespace {

void WritePeerCounters(Writer& w, const std::vector<PeerMetrics>& peers) {
  struct PeerCounter {
    const char* name;
    const char* help;
    uint64_t PeerMetrics::*field;
  };
  const PeerCounter counters[] = {
      {"kvferry_requests_total", "Requests submitted to the peer.", &PeerMetrics::requests},
      {"kvferry_requests_ok_total", "Requests to the peer that succeeded.",
       &PeerMetrics::requests_ok},
      {"kvferry_slices_total", "Slices posted to the peer, re-posts included.",
       &PeerMetrics::slices},
      {"kvferry_retries_total", "Slices re-posted after a failure.", &PeerMetrics::retries},
      {"kvferry_reconnects_total", "Times the links to the peer were rebuilt.",
       &PeerMetrics::reconnects},
  };
  for (const PeerCounter& c : counters) {
    w.Family(c.name, "counter", c.help);
    for (const PeerMetrics& p : peers) w.Sample(c.name, Label("peer", p.peer), p.*c.field);
  }
  w.Family("kvferry_peer_transport", "gauge",
           "1 for the transport each peer's data goes over (why: the engine's log).");
  for (const PeerMetrics& p : peers) {
    w.Sample("kvferry_peer_transport",
             Label("peer", p.peer) + "," + Label("transport", p.transport), 1);
  }
  w.Family("kvferry_peer_links", "gauge", "Links open to the peer (failed ones not counted).");
  for (const PeerMetrics& p : peers) w.Sample("kvferry_peer_links", Label("peer", p.peer), p.links);
  w.Family("kvferry_bytes_total", "counter", "Bytes moved by successful requests.");
  for (const PeerMetrics& p : peers) {
    w.Sample("kvferry_bytes_total", Label("peer", p.peer) + ",op=\"write\"", p.bytes_written);
    w.Sample("kvferry_bytes_total", Label("peer", p.peer) + ",op=\"read\"", p.bytes_read);
  }
  w.Family("kvferry_request_errors_total", "counter", "Failed requests, by status code.");
  for (const PeerMetrics& p : peers) {
    for (const auto& [code, n] : p.errors) {
      w.Sample("kvferry_request_errors_total", Label("peer", p.peer) + "," + Label("code", code),
               n);
    }
  }
}

void WritePeerLatency(Writer& w, const std::vector<PeerMetrics>& peers) {
  w.Family("kvferry_request_latency_seconds", "histogram",
           "Time from Submit to the request's completion.");
  for (const PeerMetrics& p : peers) {
    const std::vector<uint64_t> c = p.latency.Cumulative();
    const std::vector<double>& bounds = LatencyHistogram::Bounds();
    for (size_t i = 0; i < c.size(); ++i) {
      const std::string le =
          i < bounds.size() ? absl::StrFormat("%g", bounds[i]) : std::string("+Inf");
      w.Sample("kvferry_request_latency_seconds_bucket",
               Label("peer", p.peer) + "," + Label("le", le), c[i]);
    }
    w.Sample("kvferry_request_latency_seconds_sum", Label("peer", p.peer), p.latency.sum_seconds());
    w.Sample("kvferry_request_latency_seconds_count", Label("peer", p.peer), p.latency.count());
  }
}

void WriteNics(Writer& w, const std::vector<NicMetrics>& nics) {
  w.Family("kvferry_nic_slices_total", "counter", "Slices posted on the NIC.");
  for (const NicMetrics& n : nics)
    w.Sample("kvferry_nic_slices_total", Label("nic", n.name), n.slices);
  w.Family("kvferry_nic_bytes_total", "counter", "Bytes posted on the NIC.");
  for (const NicMetrics& n : nics)
    w.Sample("kvferry_nic_bytes_total", Label("nic", n.name), n.bytes);
  w.Family("kvferry_nic_errors_total", "counter", "Slices that failed on the NIC, by status code.");
  for (const NicMetrics& n : nics) {
    for (const auto& [code, count] : n.errors_by_code) {
      w.Sample("kvferry_nic_errors_total", Label("nic", n.name) + "," + Label("code", code), count);
    }
  }
  w.Family("kvferry_nic_retries_total", "counter", "Failed slices of the NIC that were re-posted.");
  for (const NicMetrics& n : nics)
    w.Sample("kvferry_nic_retries_total", Label("nic", n.name), n.retries);
}

void WriteEngineCounters(Writer& w, const EngineMetrics& m) {
  const std::pair<const char*, uint64_t> engine_counters[] = {
      {"kvferry_handshakes_refused_total", m.handshakes_refused},
      {"kvferry_link_failovers_total", m.link_failovers},
      {"kvferry_probes_total", m.probes},
      {"kvferry_probes_failed_total", m.probes_failed},
      {"kvferry_peers_fenced_total", m.peers_fenced},
  };
  const char* helps[] = {"Handshake requests refused for lack of the secret.",
                         "Slices moved off a failed link to another.",
                         "Peers probed after a silence.", "Probes that got no answer.",
                         "Peer instances fenced off this engine (declared failed)."};
  static_assert(sizeof helps / sizeof helps[0] ==
                sizeof engine_counters / sizeof engine_counters[0]);
  for (size_t i = 0; i < sizeof helps / sizeof helps[0]; ++i) {
    w.Family(engine_counters[i].first, "counter", helps[i]);
    w.Sample(engine_counters[i].first, "", engine_counters[i].second);
  }
  w.Family("kvferry_refused_input_total", "counter",
           "Network input refused or cut off (connections, frames, requests), by reason.");
  for (const auto& [reason, count] : m.refused_input) {
    w.Sample("kvferry_refused_input_total", Label("reason", reason), count);
  }
}

}  // namespace

std::string PrometheusText(const EngineMetrics& m, const std::string& engine) {
  std::string out;
  Writer w(&out, engine);
  WritePeerCounters(w, m.peers);
  WritePeerLatency(w, m.peers);
  WriteNics(w, m.nics);
  WriteEngineCounters(w, m);
  return out;
}

}  // namespace kvferry
