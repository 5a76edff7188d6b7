// The colocated reference of the example model: greedy generation computed directly on one
// kernels::Model in this process (the whole prompt, then one token per step). The CPU model is
// bit-for-bit deterministic, so every host run — disaggregated or colocated, any TP/PP, any
// batching — must produce exactly these tokens. pd-demo and the tests compare against it.
#ifndef PDLIB_EXAMPLES_HOSTS_REFERENCE_H_
#define PDLIB_EXAMPLES_HOSTS_REFERENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::hosts {

// `model` is one of the hosts' --model names (ModelConfigByName: small, small-hybrid, small-mla,
// small-swa, small-nsa), `seed` their --seed. Always the whole model on one rank (TP 1, PP 1).
StatusOr<std::vector<int32_t>> GenerateReference(const std::string& model, uint64_t seed,
                                                 const std::vector<int32_t>& prompt,
                                                 int32_t max_new_tokens);

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_REFERENCE_H_
