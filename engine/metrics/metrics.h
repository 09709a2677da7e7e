// What an engine has done, for operators: counters per peer and per NIC,
// request latency histograms, and the Prometheus text format of all of it.
// TransferEngine::GetMetrics() returns a snapshot; with
// EngineOptions::metrics_port set, the engine serves PrometheusText() at
// http://<bind host>:<port>/metrics.
#ifndef KVFERRY_ENGINE_METRICS_METRICS_H_
#define KVFERRY_ENGINE_METRICS_METRICS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace kvferry {

// Request latency (Submit to the request's last slice done), cumulative
// Prometheus-style buckets.
class LatencyHistogram {
 public:
  // Upper bounds of the buckets, in seconds: 10 us to 10 s, then +Inf.
  static const std::vector<double>& Bounds();
  void Record(absl::Duration d);
  // The bucket a latency of `ns` nanoseconds falls in, and Record for such
  // a latency whose bucket is known: what records the same latency many
  // times (the requests of a batch finished by one poll) finds it once.
  static size_t BucketOf(int64_t ns);
  void RecordNs(int64_t ns, size_t bucket) {
    ++buckets_[bucket];
    ++count_;
    sum_seconds_ += static_cast<double>(ns) / 1e9;
  }
  // Adds `other`'s observations to these.
  void Merge(const LatencyHistogram& other);
  // Cumulative()[i]: observations <= Bounds()[i]; the last entry is +Inf (all).
  std::vector<uint64_t> Cumulative() const;
  uint64_t count() const { return count_; }
  double sum_seconds() const { return sum_seconds_; }
  // The smallest bucket bound below which `q` (0..1) of the observations
  // fall; +Inf as a large number if beyond the last bound; 0 if empty.
  double QuantileBound(double q) const;

 private:
  std::vector<uint64_t> buckets_ = std::vector<uint64_t>(Bounds().size() + 1, 0);  // +Inf last
  uint64_t count_ = 0;
  double sum_seconds_ = 0;
};

// Records `now - submitted` into a histogram, remembering the last pair:
// the requests of a batch, each its own slice, finish one by one with the
// same submission time and the same poll's `now`, and then cost no time
// arithmetic and no bucket search.
class LatencyMemo {
 public:
  void Record(LatencyHistogram& into, absl::Time submitted, absl::Time now) {
    if (submitted != submitted_ || now != now_) {
      submitted_ = submitted;
      now_ = now;
      ns_ = absl::ToInt64Nanoseconds(now - submitted);  // saturates: +Inf lands last
      bucket_ = LatencyHistogram::BucketOf(ns_);
    }
    into.RecordNs(ns_, bucket_);
  }

 private:
  absl::Time submitted_ = absl::InfinitePast();
  absl::Time now_ = absl::InfinitePast();
  int64_t ns_ = 0;
  size_t bucket_ = 0;
};

struct PeerMetrics {
  std::string peer;                        // "host:port"
  std::string transport;                   // the kind its data goes over ("verbs", "tcp", ...)
  std::string transport_reason;            // why that one
  uint64_t requests = 0;                   // submitted
  uint64_t requests_ok = 0;                // ... that succeeded
  uint64_t bytes_written = 0;              // by successful WRITE requests
  uint64_t bytes_read = 0;                 // by successful READ requests
  uint64_t slices = 0;                     // posted, re-posts included
  uint64_t retries = 0;                    // slices re-posted after a failure
  uint64_t reconnects = 0;                 // times its links were rebuilt
  uint32_t links = 0;                      // links to it now, failed ones not counted
  std::map<std::string, uint64_t> errors;  // failed requests by status code
  LatencyHistogram latency;
};

// Adds what `from` counted of requests, slices, results and latency to
// `into` (its peer, transport, retries, reconnects and links are kept).
void AddCounts(const PeerMetrics& from, PeerMetrics* into);

struct NicMetrics {
  std::string name;     // the transport's NIC name, e.g. "mlx5_0:1"
  uint64_t slices = 0;  // posted on it, re-posts included
  uint64_t bytes = 0;
  uint64_t errors = 0;                             // slices that failed on it
  std::map<std::string, uint64_t> errors_by_code;  // ... by status code
  uint64_t retries = 0;                            // failed slices of it that were re-posted
};

struct EngineMetrics {
  std::vector<PeerMetrics> peers;
  std::vector<NicMetrics> nics;
  uint64_t handshakes_refused = 0;
  uint64_t link_failovers = 0;
  uint64_t probes = 0;
  uint64_t probes_failed = 0;
  uint64_t peers_fenced = 0;
  // Network input refused or cut off, by reason (docs/security.md): the
  // handshake server's and the transports' counts.
  std::vector<std::pair<std::string, uint64_t>> refused_input;
};

// The Prometheus text exposition format (version 0.0.4) of `m`; `engine`
// labels every series (e.g. the engine's address).
std::string PrometheusText(const EngineMetrics& m, const std::string& engine);

}  // namespace kvferry

#endif  // KVFERRY_ENGINE_METRICS_METRICS_H_
