// Rate limits a log line that input from the network can trigger, so that a
// flood of bad requests cannot flood the log: at most one line per
// `interval`, which says how many were suppressed since the last.
//
//   if (uint64_t skipped; limiter.Allow(&skipped)) {
//     KVF_LOG(WARNING) << "refused …" << LogLimiter::Suffix(skipped);
//   }
#ifndef KVFERRY_BASE_LOG_LIMITER_H_
#define KVFERRY_BASE_LOG_LIMITER_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace kvferry {

class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval = absl::Seconds(1)) : interval_(interval) {}
  // True when a line may be logged now; `*suppressed` gets the number of
  // lines refused since the last one allowed.
  bool Allow(uint64_t* suppressed) {
    MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_ < interval_) {
      ++suppressed_;
      return false;
    }
    last_ = now;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }
  static std::string Suffix(uint64_t suppressed) {
    return suppressed == 0 ? std::string()
                           : absl::StrCat(" (", suppressed, " similar lines suppressed)");
  }

 private:
  const absl::Duration interval_;
  Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvferry

#endif  // KVFERRY_BASE_LOG_LIMITER_H_
