// HTTP/1.1 request parsing and response formatting for the router's small HTTP server: pure
// functions over byte buffers (no sockets), so that every malformed input is unit-tested.
//
// Supported: one request per connection (responses say `Connection: close`), bodies delimited by
// Content-Length, `Expect: 100-continue`. Not supported, with a clear error: chunked request
// bodies (501), obsolete header line folding (400). Limits bound the header block (431) and the
// body (413) before either is buffered whole. Thread-safe (no shared state).
#ifndef PDLIB_EXAMPLES_ROUTER_HTTP_H_
#define PDLIB_EXAMPLES_ROUTER_HTTP_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pdlib::router {

struct HttpLimits {
  size_t max_header_bytes = 16 * 1024;  // request line and headers, with their line ends
  size_t max_body_bytes = 1024 * 1024;
};

struct HttpRequest {
  std::string method;   // as sent: "GET", "POST", ...
  std::string target;   // "/v1/completions" (a query string is kept; see Path())
  std::string version;  // "HTTP/1.1" or "HTTP/1.0"
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  bool expect_continue = false;

  // The value of header `name` (lower case), or nullptr.
  const std::string* Header(std::string_view name) const;
  // The target without its query string.
  std::string_view Path() const;
};

struct HttpParseResult {
  enum class State {
    kIncomplete,  // need more bytes; `headers_done` tells whether the header block is in
    kComplete,    // `request` is whole
    kError,       // answer `error_status` with `error_message` and close
  };
  State state = State::kIncomplete;
  bool headers_done = false;  // with kIncomplete: only the body is missing
  HttpRequest request;        // with kComplete (and the headers with headers_done)
  int error_status = 0;
  std::string error_message;
};

// Parses the request at the start of `data`. Call again with more bytes while kIncomplete.
HttpParseResult ParseHttpRequest(std::string_view data, const HttpLimits& limits);

// "OK", "Bad Request", ... for the status codes the router uses.
std::string_view HttpReason(int status);

// A whole response with Content-Length and `Connection: close`.
std::string FormatHttpResponse(int status, std::string_view content_type, std::string_view body);

// The head of a response whose body runs until the connection closes (server-sent events).
std::string FormatHttpStreamHead(int status, std::string_view content_type);

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_HTTP_H_
