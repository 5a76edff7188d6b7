// Internal logging: PDLIB_LOG(kInfo, "room=%d moved to %s", room, name). Formats with
// absl::StrFormat only when the level is enabled, then hands the line to the sink (pdlib/log.h).
#ifndef PDLIB_LIB_BASE_LOG_INTERNAL_H_
#define PDLIB_LIB_BASE_LOG_INTERNAL_H_

#include <atomic>
#include <string_view>

#include "absl/strings/str_format.h"
#include "pdlib/log.h"

namespace pdlib {
inline namespace v1 {
namespace internal {

// The current level; relaxed loads are enough: a level change may take a moment to be seen.
extern std::atomic<int> g_log_level;

inline bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_log_level.load(std::memory_order_relaxed);
}
void EmitLog(LogLevel level, const char* file, int line, std::string_view message);

}  // namespace internal
}  // namespace v1
}  // namespace pdlib

// A per-room anchor (SPEC R10.3) at info level, for a room chosen when it was created
// (`sampled`: RoomState::logged(), per KVManagerOptions::room_log_every).
#define PDLIB_ROOM_LOG(sampled, ...)                                            \
  do {                                                                          \
    if (::pdlib::internal::LogEnabled(::pdlib::LogLevel::kInfo) && (sampled)) { \
      ::pdlib::internal::EmitLog(::pdlib::LogLevel::kInfo, __FILE__, __LINE__,  \
                                 ::absl::StrFormat(__VA_ARGS__));               \
    }                                                                           \
  } while (0)

#define PDLIB_LOG(level, ...)                                                  \
  do {                                                                         \
    if (::pdlib::internal::LogEnabled(::pdlib::LogLevel::level)) {             \
      ::pdlib::internal::EmitLog(::pdlib::LogLevel::level, __FILE__, __LINE__, \
                                 ::absl::StrFormat(__VA_ARGS__));              \
    }                                                                          \
  } while (0)

#endif  // PDLIB_LIB_BASE_LOG_INTERNAL_H_
