#include "pdlib/log.h"

#include <errno.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"

namespace pdlib {
inline namespace v1 {
namespace {

int LevelFromEnv() {
  const char* env = std::getenv("PDLIB_LOG_LEVEL");
  if (env == nullptr) return static_cast<int>(LogLevel::kWarning);
  std::string v = absl::AsciiStrToLower(env);
  if (v == "debug") return static_cast<int>(LogLevel::kDebug);
  if (v == "info") return static_cast<int>(LogLevel::kInfo);
  if (v == "warning" || v == "warn") return static_cast<int>(LogLevel::kWarning);
  if (v == "error") return static_cast<int>(LogLevel::kError);
  if (v == "off" || v == "none") return static_cast<int>(LogLevel::kOff);
  std::fprintf(stderr, "pdlib: ignoring PDLIB_LOG_LEVEL=%s (want debug|info|warning|error|off)\n",
               env);
  return static_cast<int>(LogLevel::kWarning);
}

char LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
    case LogLevel::kOff: break;
  }
  return '?';
}

// The default sink: one write(2) per line, so that lines of concurrent threads never
// interleave, and no lock of pdlib's or stdio's is held while writing.
void StderrSink(LogLevel level, std::string_view file, int line, std::string_view message) {
  auto slash = file.rfind('/');
  if (slash != std::string_view::npos) file.remove_prefix(slash + 1);
  // libc time formatting, not absl::FormatTime: Debian's Abseil time-zone code is not
  // TSan-instrumented and would be reported from every thread that logs. Formatted once per
  // second per thread: localtime_r takes a process-wide lock.
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  auto micros = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()) %
                std::chrono::seconds(1);
  thread_local std::time_t stamp_secs = -1;
  thread_local char stamp[32];
  if (secs != stamp_secs) {
    std::tm tm{};
    localtime_r(&secs, &tm);
    std::strftime(stamp, sizeof(stamp), "%m%d %H:%M:%S", &tm);
    stamp_secs = secs;
  }
  thread_local std::string out;
  out.clear();
  absl::StrAppendFormat(&out, "%c%s.%06d pdlib %s:%d] ", LevelLetter(level), stamp, micros.count(),
                        file, line);
  out.append(message);
  out.push_back('\n');
  for (size_t done = 0; done < out.size();) {
    ssize_t n = ::write(STDERR_FILENO, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to log to: drop the line
    done += size_t(n);
  }
}

// The sink is swapped rarely and called often: readers copy the shared_ptr under the lock, and
// the default sink (none set) takes no lock at all.
Mutex g_sink_mu;
std::shared_ptr<const LogSink> g_sink ABSL_GUARDED_BY(g_sink_mu);
std::atomic<bool> g_has_sink{false};

}  // namespace

namespace internal {
std::atomic<int> g_log_level{LevelFromEnv()};

void EmitLog(LogLevel level, const char* file, int line, std::string_view message) {
  if (!g_has_sink.load(std::memory_order_acquire)) return StderrSink(level, file, line, message);
  std::shared_ptr<const LogSink> sink;
  {
    MutexLock lock(&g_sink_mu);
    sink = g_sink;
  }
  if (sink) {
    (*sink)(level, file, line, message);
  } else {
    StderrSink(level, file, line, message);
  }
}
}  // namespace internal

void SetLogSink(LogSink sink) {
  auto next = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
  MutexLock lock(&g_sink_mu);
  g_has_sink.store(next != nullptr, std::memory_order_release);
  g_sink = std::move(next);
}

void SetLogLevel(LogLevel level) {
  internal::g_log_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel GetLogLevel() {
  return static_cast<LogLevel>(internal::g_log_level.load(std::memory_order_relaxed));
}

}  // namespace v1
}  // namespace pdlib
