// The decode scheduler's memory arithmetic as pure functions (SPEC R9.2, R9.3), so that tests can
// check every term.
#ifndef PDLIB_EXAMPLES_SCHEDULER_DECODE_MEMORY_H_
#define PDLIB_EXAMPLES_SCHEDULER_DECODE_MEMORY_H_

#include <cstdint>
#include <optional>
#include <span>

namespace pdlib::sched {

// Inputs of the allocatable-token formula, all in tokens or request counts.
struct AllocatableTokensInput {
  int64_t available_tokens = 0;        // free KV pages x page_size
  int64_t reserved_decode_tokens = 0;  // kept free per request for its coming decode steps
  int64_t num_running = 0;
  int64_t num_transfer = 0;
  int64_t num_waiting = 0;
  // max over running requests of prompt + min(max_new_tokens, clip): the most one request can
  // ever hold. 0 when nothing runs.
  int64_t max_single_request_need = 0;
  // Tokens the running requests hold (and would give back if retracted).
  int64_t retractable_tokens = 0;
  // Sum over retracted requests of prompt + outputs + reserved_decode_tokens: what resuming
  // them will take. Leave 0 when computing what is left for resuming them.
  int64_t retracted_need = 0;
};

// allocatable = available - max(reserved_decode_tokens * (running + transfer + waiting),
//                               max_single_request_need - retractable_tokens)
//               - retracted_need
// The first term keeps room for the next decode steps of every admitted request; the second
// keeps room for the largest running request to finish even if every other one is retracted.
// May be negative.
int64_t AllocatableTokens(const AllocatableTokensInput& in);

// Whether one more request (prompt of `prompt_tokens`, at most `max_new_tokens` outputs after
// clipping) may be pre-allocated out of `allocatable` tokens. Two checks, both needed so the
// request can always make progress: what it takes now (prompt + reserved decode tokens) and its
// worst case (prompt + max_new_tokens, less what retracting the running batch would free).
// Returns the tokens to charge against `allocatable`, or nullopt.
std::optional<int64_t> PreallocCharge(int64_t allocatable, int64_t prompt_tokens,
                                      int64_t max_new_tokens, int64_t reserved_decode_tokens,
                                      int64_t retractable_tokens);

// A running request as retraction sees it.
struct RetractCandidate {
  int64_t output_tokens = 0;
  int64_t prompt_tokens = 0;
};

// The index of the running request to retract next: the one with the fewest output tokens (it
// loses the least progress), on ties the longest prompt (it frees the most), on ties the latest
// in the batch. nullopt for an empty batch.
std::optional<size_t> PickRetractVictim(std::span<const RetractCandidate> running);

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_DECODE_MEMORY_H_
