// Validation of everything an engine or a peer hands pdlib (SPEC R3.2): pure functions that
// return a Status naming the bad field, index and range.
#ifndef PDLIB_LIB_CORE_VALIDATE_H_
#define PDLIB_LIB_CORE_VALIDATE_H_

#include <cstdint>
#include <span>
#include <string_view>

#include "pdlib/kv_args.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// Number of items every buffer of `family` can hold: min over i of lens[i] / item_lens[i].
uint64_t ItemCapacity(const BufferFamily& family);

// Checks the shape of one family: equal-length vectors, non-null pointers, non-zero item sizes
// that fit in their buffer. `what` names the family in messages ("kv", "aux", "state").
Status ValidateFamily(const BufferFamily& family, std::string_view what);

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
