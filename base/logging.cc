#include "base/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace kvferry {
namespace {

std::atomic<int> threshold{-1};  // -1: not read from the environment yet

int ThresholdFromEnv() {
  LogSeverity s = LogSeverity::kInfo;
  if (const char* env = std::getenv("KVFERRY_LOG_LEVEL")) {
    if (!ParseLogSeverity(env, &s)) s = LogSeverity::kInfo;
  }
  return static_cast<int>(s);
}

Mutex& SinkMutex() {
  static Mutex* const mu = new Mutex;
  return *mu;
}
LogSink& Sink() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  static LogSink* const sink = new LogSink;
  return *sink;
}

char SeverityLetter(LogSeverity s) {
  switch (s) {
    case LogSeverity::kDebug:
      return 'D';
    case LogSeverity::kInfo:
      return 'I';
    case LogSeverity::kWarning:
      return 'W';
    case LogSeverity::kError:
      return 'E';
  }
  return '?';
}

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

}  // namespace

bool LogEnabled(LogSeverity severity) {
  int t = threshold.load(std::memory_order_relaxed);
  if (ABSL_PREDICT_FALSE(t < 0)) {
    t = ThresholdFromEnv();
    threshold.store(t, std::memory_order_relaxed);
  }
  return static_cast<int>(severity) >= t;
}

void SetLogThreshold(LogSeverity severity) {
  threshold.store(static_cast<int>(severity), std::memory_order_relaxed);
}

bool ParseLogSeverity(absl::string_view text, LogSeverity* out) {
  std::string t = absl::AsciiStrToLower(text);
  if (t == "debug") {
    *out = LogSeverity::kDebug;
  } else if (t == "info") {
    *out = LogSeverity::kInfo;
  } else if (t == "warning" || t == "warn") {
    *out = LogSeverity::kWarning;
  } else if (t == "error") {
    *out = LogSeverity::kError;
  } else {
    return false;
  }
  return true;
}

void SetLogSink(LogSink sink) {
  MutexLock lock(&SinkMutex());
  Sink() = std::move(sink);
}

namespace log_internal {

LogMessage::LogMessage(LogSeverity severity, const char* file, int line)
    : severity_(severity) {
  stream_ << SeverityLetter(severity)
          << absl::FormatTime("%Y%m%d %H:%M:%E6S", absl::Now(),
                              absl::LocalTimeZone())
          << ' ' << static_cast<long>(syscall(SYS_gettid)) << ' '
          << Basename(file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  std::string text = stream_.str();
  MutexLock lock(&SinkMutex());
  if (Sink()) {
    Sink()(severity_, text);
    return;
  }
  text.push_back('\n');
  // One write so concurrent lines do not interleave.
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
}

}  // namespace log_internal
}  // namespace kvferry
