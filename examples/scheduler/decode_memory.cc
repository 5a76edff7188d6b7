#include "examples/scheduler/decode_memory.h"

#include <algorithm>

namespace pdlib::sched {

int64_t AllocatableTokens(const AllocatableTokensInput& in) {
  const int64_t reserved =
      in.reserved_decode_tokens * (in.num_running + in.num_transfer + in.num_waiting);
  const int64_t single = in.max_single_request_need - in.retractable_tokens;
  return in.available_tokens - std::max(reserved, single) - in.retracted_need;
}

std::optional<int64_t> PreallocCharge(int64_t allocatable, int64_t prompt_tokens,
                                      int64_t max_new_tokens, int64_t reserved_decode_tokens,
                                      int64_t retractable_tokens) {
  const int64_t now = prompt_tokens + reserved_decode_tokens;
  const int64_t worst = prompt_tokens + max_new_tokens - retractable_tokens;
  if (std::max(now, worst) > allocatable) return std::nullopt;
  return now;
}

std::optional<size_t> PickRetractVictim(std::span<const RetractCandidate> running) {
  std::optional<size_t> best;
  for (size_t i = 0; i < running.size(); ++i) {
    if (!best) {
      best = i;
      continue;
    }
    const RetractCandidate& b = running[*best];
    const RetractCandidate& c = running[i];
    if (c.output_tokens < b.output_tokens ||
        (c.output_tokens == b.output_tokens && c.prompt_tokens >= b.prompt_tokens)) {
      best = i;
    }
  }
  return best;
}

}  // namespace pdlib::sched
