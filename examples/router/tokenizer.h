// The example deployment's stand-in tokenizer: byte-level. A text prompt becomes one token per
// byte (token id = byte value, 0..255); output ids below 256 become those bytes again and any
// other id becomes the text "<id>". The example model (kernels/) has no real vocabulary, so this
// keeps prompts and outputs readable and lossless without one; a real deployment would put its
// model's tokenizer here. Clients that tokenize themselves send ids and read `output_ids`.
// Pure functions, thread-safe; StreamDetokenizer is one stream's state (one thread at a time).
#ifndef PDLIB_EXAMPLES_ROUTER_TOKENIZER_H_
#define PDLIB_EXAMPLES_ROUTER_TOKENIZER_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib::router {

std::vector<int32_t> Tokenize(std::string_view text);
std::string Detokenize(std::span<const int32_t> ids);

// Incremental detokenizer for streamed output: returns the text of the tokens fed so far that is
// safe to send, holding back the bytes of a UTF-8 character whose remaining bytes may still come
// (so that a JSON writer does not replace half a character). Finish() returns what is held back.
class StreamDetokenizer {
 public:
  std::string Feed(int32_t id);
  std::string Finish();

 private:
  std::string pending_;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_TOKENIZER_H_
