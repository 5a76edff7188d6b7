// A transport for fuzzing the protocol cores: moves no bytes, completes every batch inline, and
// aborts the process (__builtin_trap, after printing the op) when a posted write leaves the
// local region it names or the remote region as the peer declared it (the length from its
// Register message, handed to ImportRemoteRegion). That is the property control_fuzz checks:
// whatever a hostile decode sends, prefill never plans a write outside what both sides
// registered.
//
// Registered under kCheckedTransportName by RegisterCheckedTransport() (once per process);
// thread-safe like every transport.
#ifndef PDLIB_FUZZ_CHECKED_TRANSPORT_H_
#define PDLIB_FUZZ_CHECKED_TRANSPORT_H_

#include <atomic>
#include <cstdint>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace fuzzing {

inline constexpr char kCheckedTransportName[] = "fuzz-checked";

// Endpoint blobs Connect refuses, and remote keys ImportRemoteRegion refuses, start with this
// byte: lets the fuzzer reach the core's error paths for both.
inline constexpr uint8_t kRefusedBlobMarker = 0xEE;

// Counters over every instance, for the fuzzer's statistics.
struct CheckedTransportStats {
  std::atomic<uint64_t> batches{0};
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> bytes{0};
};
CheckedTransportStats& GlobalCheckedTransportStats();

// Registers the factory with spi::RegisterTransport; later calls do nothing.
Status RegisterCheckedTransport();

// TransportOptions::options key: "1" makes every other batch complete with kUnavailable (a dead
// peer) instead of OK, so that the failure paths after a post are covered too.
inline constexpr char kFailEveryOtherOption[] = "fuzz.fail_every_other";

}  // namespace fuzzing
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_FUZZ_CHECKED_TRANSPORT_H_
