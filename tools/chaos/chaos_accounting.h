// Pure accounting of pdlib-chaos: what one side of a request reported, which failure category
// a finished request falls in, and what a process still holds according to its METRICS line.
// No I/O, no clocks beyond the time stamp carried along.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_ACCOUNTING_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_ACCOUNTING_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace pdlib_chaos {

// One side's view of a request.
struct Outcome {
  enum Kind { kPending, kSuccess, kFailed, kBadBytes, kLost };
  Kind kind = kPending;
  // The failure reason ("UNAVAILABLE: room 7: ..."), the first wrong byte, or how the process
  // was lost ("decode0 killed", "decode0 crashed").
  std::string detail;
  uint64_t bytes = 0;         // decode Success: bytes checked
  uint64_t prefix_pages = 0;  // decode Success: pages of the request's decode prefix
  std::chrono::steady_clock::time_point at{};
};

// The failure category of a request whose sides ended as `prefill` and `decode` (`settled`:
// both are terminal), or "" when it succeeded: decode has the request's bytes and prefill did
// not fail (a prefill killed after writing them does not undo that). Categories: the status
// code of the failing side, decode's first ("UNAVAILABLE", "DEADLINE_EXCEEDED", ...);
// BAD_BYTES (decode's bytes are not the request's, or prefill was told another decode prefix);
// DECODE_KILLED / DECODE_CRASHED (decode lost, prefill not failed); BOTH_LOST;
// PREFILL_FAILED_DECODE_SUCCEEDED (the sides disagree); NOT_TERMINAL.
std::string FailureCategory(const Outcome& prefill, const Outcome& decode, bool settled);

// "UNAVAILABLE: room 7: ..." -> "UNAVAILABLE"; anything not starting with a code -> "OTHER".
std::string StatusCodeOf(std::string_view reason);

// The numeric key=value tokens of a line.
std::map<std::string, uint64_t> ParseCounters(std::string_view line);

// What a peer still holds by its METRICS counters, once nothing is in flight: "rooms" (live
// rooms and queued ones), "handles", "aux_slots", "pages", "state_items" (mamba slots, swa
// pages, ... of every state family), and "connections" beyond
// `expected_connections` (one per process of the other side). Zero everywhere when clean.
std::map<std::string, uint64_t> Leftovers(const std::map<std::string, uint64_t>& metrics,
                                          uint64_t expected_connections);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_ACCOUNTING_H_
