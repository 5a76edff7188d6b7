// The HTTP/JSON API's request and response bodies: `POST /v1/completions` with the basics of
// OpenAI's completions API, so that curl and simple clients work. Pure functions.
//
// Request: {"prompt": "text" | [ids], "max_tokens": N, "stream": false}. `prompt` text is
// tokenized byte by byte (tokenizer.h); `max_tokens` is optional (the router's default) and
// must be >= 1; `n` must be 1 if given; other fields (model, temperature, ...) are accepted and
// ignored, since the example model decodes greedily. Response: an OpenAI-style text_completion
// with a `pdlib` object holding the router's measurements, the picked hosts and the output ids.
// Errors: {"error": {"message", "type", "code"}} with the HTTP status from HttpStatusFor().
// With "stream": true the response is server-sent events: one text_completion chunk per piece
// of text, a last chunk with finish_reason, usage and pdlib, then `data: [DONE]`.
#ifndef PDLIB_EXAMPLES_ROUTER_COMPLETIONS_H_
#define PDLIB_EXAMPLES_ROUTER_COMPLETIONS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "examples/router/request.h"
#include "pdlib/status.h"

namespace pdlib::router {

struct CompletionRequest {
  RouterRequest request;
  bool stream = false;
};

// Errors are INVALID_ARGUMENT naming the offending field.
StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                   int32_t default_max_new_tokens);

// "length" when the request produced max_new_tokens tokens, else "stop".
std::string_view FinishReason(const RequestResult& result);

// The whole JSON body of a successful non-streamed completion. `created`: Unix seconds.
std::string FormatCompletion(const RequestResult& result, int64_t created);

// One server-sent event ("data: {...}\n\n") carrying `text`.
std::string FormatCompletionChunk(uint64_t room, int64_t created, std::string_view text);
// The last event of a successful stream: remaining `text`, finish_reason, usage and pdlib, then
// "data: [DONE]\n\n".
std::string FormatCompletionLastChunk(const RequestResult& result, int64_t created,
                                      std::string_view text);

// {"error": {...}}. `result` (may be null) adds the room and the picked hosts.
std::string FormatError(const Status& status, const RequestResult* result);
// 400 for the client's errors, 429, 503, 504, and 502 for a host's failure.
int HttpStatusFor(StatusCode code);

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_COMPLETIONS_H_
