// A small, strict JSON reader for the safetensors header. It builds a tree, bounds nesting
// depth, and reports the byte offset of the first error. Integers that fit in uint64 are kept
// exactly (tensor offsets may exceed 2^53), everything else numeric as a double.
#ifndef PDLIB_KERNELS_SRC_JSON_H_
#define PDLIB_KERNELS_SRC_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::kernels::internal {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Type type = Type::kNull;
  bool boolean = false;
  double number = 0.0;
  // For numbers: true when the literal is a non-negative integer that fits in uint64.
  bool is_uint = false;
  uint64_t uint_value = 0;
  std::string string;
  std::vector<JsonValue> items;   // array elements, or object values
  std::vector<std::string> keys;  // object keys, parallel to items
  // The value of `key` in an object, or nullptr (also when this is not an object).
  const JsonValue* Find(std::string_view key) const;
};

// Parses exactly one JSON value (surrounding whitespace allowed). Nesting deeper than
// `max_depth` is an error, so hostile input cannot exhaust the stack.
StatusOr<JsonValue> ParseJson(std::string_view text, int max_depth = 32);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_JSON_H_
