// The small enums shared by every part of pdlib's API.
#ifndef PDLIB_TYPES_H_
#define PDLIB_TYPES_H_

#include <cstdint>
#include <string_view>

#include "pdlib/export.h"

namespace pdlib {
inline namespace v1 {

// Transfer state of one request on one rank (SPEC R2.1). The numbering is part of the contract:
// Failed is 0 so that a MIN all-reduce across TP ranks makes every rank agree on failure, and the
// other states grow in the order a request moves through them.
enum class KVPoll : int32_t {
  kFailed = 0,
  kBootstrapping = 1,
  kWaitingForInput = 2,
  kTransferring = 3,
  kSuccess = 4,
};

// True for Success and Failed: states a handle never leaves (SPEC R2.2).
constexpr bool IsTerminal(KVPoll state) {
  return state == KVPoll::kSuccess || state == KVPoll::kFailed;
}

// "Failed", "Bootstrapping", ...
PDLIB_EXPORT std::string_view KVPollName(KVPoll state);

// Which side of the disaggregation a KVManager serves.
enum class Mode : int32_t {
  kPrefill = 0,  // owns KV that it writes into decode memory
  kDecode = 1,   // owns the memory that prefill writes into
};
PDLIB_EXPORT std::string_view ModeName(Mode mode);

// Which way KV moves (SPEC R11.4; KVManagerOptions::direction, the same on both sides).
enum class TransferDirection : int32_t {
  // Prefill writes into the pages decode named (one-sided writes; decode's memory is exposed).
  kPush = 0,
  // Prefill publishes its pages and keeps them under a lease; decode reads them into its own
  // pages (one-sided reads; prefill's memory is exposed) and says when it is done.
  kPull = 1,
};
// "push", "pull".
PDLIB_EXPORT std::string_view TransferDirectionName(TransferDirection direction);

// Per-request state that hybrid models carry besides the paged KV (SPEC R5.8), one family per
// kind (KVArgs::state_families). What one request's index list for the family means:
enum class StateType : int32_t {
  kNone = 0,
  kMamba = 1,  // recurrent state: one slot per request (0 or 1 index)
  kSwa = 2,    // sliding-window attention: the pages inside the window (at most the request's
               // pages; may differ by one page between the sides, see KVArgs::state_families)
  kNsa = 3,    // DeepSeek sparse attention (SGLang "nsa"/"dsa") index keys: one index per page of
               // the whole sequence (or of the pages sent, with a decode prefix)
  kMinimaxIndexK = 4,  // MiniMax's index keys: full-sequence pages, as kNsa
  kSwaRing = 5,        // ring rows of a sliding window: as many rows as prefill sends
  kC128State = 6,      // one request-scoped slot, or none (0 or 1 index)
};
inline constexpr StateType kDsa = StateType::kNsa;  // SGLang's newer name for the same kind
// "none", "mamba", "swa", "nsa", "minimax_index_k", "swa_ring", "c128_state".
PDLIB_EXPORT std::string_view StateTypeName(StateType type);

// Where a registered buffer lives.
enum class MemoryKind : int32_t {
  kHost = 0,  // ordinary (ideally pinned) host memory
  kCuda = 1,  // CUDA device memory on KVArgs::device_id
};
PDLIB_EXPORT std::string_view MemoryKindName(MemoryKind kind);

// Byte layout of one page of one KV buffer. The planner uses it to slice heads for M:N TP.
enum class KVLayout : int32_t {
  kNHD = 0,  // [token][head][dim]: a head slice is page_size small pieces
  kHND = 1,  // [head][token][dim]: a head slice is one contiguous piece per page
};
PDLIB_EXPORT std::string_view KVLayoutName(KVLayout layout);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_TYPES_H_
