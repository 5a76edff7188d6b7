// pdlib's one JSON reader, for input from outside the process: safetensors headers (kernels)
// and the router's HTTP request bodies (examples/router). nlohmann-json does the parsing; this
// adds what both callers need on top of it, so that neither keeps a parser of its own:
//   - the limits: nesting deeper than `max_depth` is an error, so hostile input cannot make a
//     document that later recursion (dump, comparison) cannot handle;
//   - duplicate object keys are an error (nlohmann would keep the last one silently, and a
//     safetensors header with a tensor twice must be rejected, not half-read);
//   - every error is an INVALID_ARGUMENT Status "malformed JSON at byte N: what" (N counts the
//     bytes read up to and including the one in error), never an exception.
// Integers keep their exact value: non-negative literals that fit in uint64 are
// `is_number_unsigned()` (tensor offsets may exceed 2^53), negative ones that fit in int64 are
// `is_number_integer()`, everything else numeric is a double. Strings must be valid UTF-8.
// Writers use nlohmann::json (or ordered_json, to keep field order) directly.
// A reader that wants no document (the safetensors header, read into its tensor list directly)
// derives a handler from SaxHandler and calls SaxParse; it then enforces the limits itself.
// Thread-safe (no shared state).
#ifndef PDLIB_KERNELS_SRC_JSON_H_
#define PDLIB_KERNELS_SRC_JSON_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "pdlib/status.h"

namespace pdlib::json {

// Parses exactly one JSON value (surrounding whitespace allowed).
StatusOr<nlohmann::json> ParseStrict(std::string_view text, int max_depth = 32);

// The value as an int64 when it is an integer literal that fits, else nullopt (floats, strings,
// integers beyond int64 included).
std::optional<int64_t> AsInt64(const nlohmann::json& value);

// nlohmann's SAX events, with errors as Statuses that name the byte offset. A derived handler
// reports an error of its own (a duplicate key, nesting too deep) by returning Fail(what).
// One handler serves one SaxParse call.
class SaxHandler : public nlohmann::json_sax<nlohmann::json> {
 public:
  bool binary(nlohmann::json::binary_t& b) override;  // never in JSON text: an error
  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& e) final;

  // The first error, the handler's own or the parser's; OK while there is none.
  const Status& error() const { return error_; }

 protected:
  // The bytes read so far (up to and including the current one).
  size_t offset() const { return static_cast<size_t>(*read_to_ - begin_); }
  // Records "malformed JSON at byte <offset()>: <what>"; returns false to stop the parse.
  bool Fail(std::string_view what);

 private:
  friend Status SaxParse(std::string_view text, SaxHandler* handler);
  const char* begin_ = nullptr;
  const char* const* read_to_ = &begin_;
  Status error_;
};

// Parses exactly one JSON value (surrounding whitespace allowed) into `handler`'s events; the
// first error, as handler->error() has it.
Status SaxParse(std::string_view text, SaxHandler* handler);

}  // namespace pdlib::json

#endif  // PDLIB_KERNELS_SRC_JSON_H_
