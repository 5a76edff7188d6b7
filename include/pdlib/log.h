// Logging hooks: pdlib writes its log lines through one process-wide sink, so an engine can
// route them into its own logger. The default sink writes one line per message to stderr.
// The initial level comes from PDLIB_LOG_LEVEL (debug|info|warning|error|off; default warning).
//
// Threads: the sink may be called from any pdlib thread, concurrently; it must be thread-safe.
// SetLogSink and SetLogLevel may be called at any time.
#ifndef PDLIB_LOG_H_
#define PDLIB_LOG_H_

#include <functional>
#include <string_view>

#include "pdlib/export.h"

namespace pdlib {
inline namespace v1 {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// file and line locate the pdlib source of the message; message has no trailing newline.
using LogSink =
    std::function<void(LogLevel level, std::string_view file, int line, std::string_view message)>;

// Replaces the sink; an empty function restores the default stderr sink.
PDLIB_EXPORT void SetLogSink(LogSink sink);
// Messages below `level` are dropped before they are formatted.
PDLIB_EXPORT void SetLogLevel(LogLevel level);
PDLIB_EXPORT LogLevel GetLogLevel();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LOG_H_
