// Validation of everything an engine or a peer hands pdlib (SPEC R3.2): pure functions that
// return a Status naming the bad field, index and range.
#ifndef PDLIB_LIB_CORE_VALIDATE_H_
#define PDLIB_LIB_CORE_VALIDATE_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/kv_manager.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// Number of items every buffer of `family` can hold: min over i of lens[i] / item_lens[i].
uint64_t ItemCapacity(const BufferFamily& family);

// Checks the shape of one family: equal-length vectors, non-null pointers, non-zero item sizes
// that fit in their buffer. `what` names the family in messages ("kv", "aux", "state").
Status ValidateFamily(const BufferFamily& family, std::string_view what);

// Per state family (EffectiveStateFamilies order), the items every buffer of it holds.
std::vector<uint64_t> StateCapacities(const std::vector<StateFamily>& families);

// Checks one request's state indices (StateIndices: the lists and their per-family counts)
// against each family's capacity: counts given for every family (or none, with one family),
// adding up to the indices given, each index in range. `side` names the side in messages.
Status ValidateStateIndices(std::span<const uint64_t> caps, std::span<const int32_t> indices,
                            std::span<const uint32_t> counts, std::string_view side);

// Decode prefix reuse: the prefix is whole pages and, when the prompt length is given, not
// longer than the prompt, and the pages given cover exactly the tokens after it.
Status CheckDecodePrefix(const ReceiveRequest& request, uint32_t page_size);
// ceil((prompt_len - prefix) / page_size); kOutOfRange naming both when prefix > prompt_len.
StatusOr<uint64_t> PagesAfterPrefix(uint64_t prompt_len, uint64_t prefix, uint32_t page_size);

// Checks every index in [0, capacity). `what` and `side` make the message actionable:
// "kv page index 812 (position 3) out of range [0, 512) on decode".
Status ValidateIndices(std::span<const int32_t> indices, uint64_t capacity, std::string_view what,
                       std::string_view side);

// Checks a whole KVArgs for a manager of the given mode.
// kv_dtype and state_dtype are known names (or empty), and kv_dtype agrees with dtype_bytes.
Status ValidateFingerprint(const ModelFingerprint& fp);
Status ValidateKVArgs(const KVArgs& args);
Status ValidateOptions(const KVManagerOptions& options);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_VALIDATE_H_
