// A small, strict JSON reader and writer for the router's HTTP API.
//
// Why not kernels/src/json.h: that reader is internal to the model kernels library (the
// safetensors header), has no writer, and linking the router to the model library for it would
// tie the front end to the engine. This one is the same idea, sized for request bodies.
//
// The reader builds a tree, bounds nesting depth, rejects duplicate object keys, and reports
// the byte offset of the first error. Integer literals that fit in int64 are kept exactly.
// The writer emits valid UTF-8 whatever bytes it is given (invalid sequences become U+FFFD), so
// byte-level model output never breaks a response. Thread-safe (no shared state).
#ifndef PDLIB_EXAMPLES_ROUTER_JSON_H_
#define PDLIB_EXAMPLES_ROUTER_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::router {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Type type = Type::kNull;
  bool boolean = false;
  double number = 0.0;
  bool is_int = false;  // an integer literal (no fraction or exponent) that fits in int64
  int64_t int_value = 0;
  std::string string;
  std::vector<JsonValue> items;   // array elements, or object values
  std::vector<std::string> keys;  // object keys, parallel to items

  // The value of `key` in an object, or nullptr (also when this is not an object).
  const JsonValue* Find(std::string_view key) const;
};

// "null", "boolean", "number", "string", "array", "object": for error messages.
std::string_view JsonTypeName(JsonValue::Type type);

// Parses exactly one JSON value (surrounding whitespace allowed). Errors are INVALID_ARGUMENT
// naming the byte offset.
StatusOr<JsonValue> ParseJson(std::string_view text, int max_depth = 32);

// Appends `bytes` as a quoted JSON string.
void AppendJsonString(std::string* out, std::string_view bytes);

// Builds one JSON document; commas and colons are placed automatically. Misuse (a value where
// a key is due) is a programming error and not checked beyond debug asserts.
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(std::string_view key);
  JsonWriter& String(std::string_view bytes);
  JsonWriter& Int(int64_t v);
  JsonWriter& Uint(uint64_t v);
  JsonWriter& Bool(bool v);
  JsonWriter& Null();

  const std::string& str() const { return out_; }

 private:
  void BeforeValue();

  std::string out_;
  // One entry per open container: whether it has an element yet.
  std::vector<bool> has_element_;
  bool after_key_ = false;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_JSON_H_
