// kvferry's one logging facility.
//
//   KVF_LOG(INFO) << "listening on " << addr;
//   KVF_LOG(WARNING) << "peer " << peer << " missed a heartbeat";
//
// Why our own and not glog: kvferry is linked into serving processes that
// often bring their own glog/absl-log version and flags; a tiny self-contained
// logger cannot clash with them. Each line is written with one write(2) to
// stderr (or to the sink a test installs):
//
//   I20261129 17:59:01.123456 1234 engine.cc:42] message
//
// The threshold is read once from KVFERRY_LOG_LEVEL (debug, info, warning,
// error; default info). Log an error where it is handled, not where it is
// returned.
#ifndef KVFERRY_BASE_LOGGING_H_
#define KVFERRY_BASE_LOGGING_H_

#include <functional>
#include <sstream>
#include <string>

#include "absl/strings/string_view.h"

namespace kvferry {

enum class LogSeverity { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Whether messages of `severity` are currently emitted.
bool LogEnabled(LogSeverity severity);
// Overrides the threshold (tests, tools with --verbose).
void SetLogThreshold(LogSeverity severity);
// Parses "debug", "info", "warning", "error"; false on anything else.
bool ParseLogSeverity(absl::string_view text, LogSeverity* out);

// Receives every formatted line (without the trailing newline). Passing an
// empty function restores stderr. Not for hot paths.
using LogSink = std::function<void(LogSeverity, absl::string_view line)>;
void SetLogSink(LogSink sink);

namespace log_internal {

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Makes `cond ? (void)0 : Voidify() & stream` type-check.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace log_internal
}  // namespace kvferry

#define KVF_LOG_SEVERITY_DEBUG ::kvferry::LogSeverity::kDebug
#define KVF_LOG_SEVERITY_INFO ::kvferry::LogSeverity::kInfo
#define KVF_LOG_SEVERITY_WARNING ::kvferry::LogSeverity::kWarning
#define KVF_LOG_SEVERITY_ERROR ::kvferry::LogSeverity::kError

// KVF_LOG(INFO) << ...; arguments are not evaluated when the level is off.
#define KVF_LOG(level)                                                     \
  !::kvferry::LogEnabled(KVF_LOG_SEVERITY_##level)                         \
      ? (void)0                                                            \
      : ::kvferry::log_internal::Voidify() &                               \
            ::kvferry::log_internal::LogMessage(KVF_LOG_SEVERITY_##level,  \
                                                __FILE__, __LINE__)        \
                .stream()

#endif  // KVFERRY_BASE_LOGGING_H_
