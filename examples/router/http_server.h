// HttpServer: the router's HTTP/1.1 server. cpp-httplib parses requests and writes responses
// (keep-alive, chunked bodies for streams, `Expect: 100-continue`); this class adds what the
// router needs on top of it:
//   - a bounded thread pool: one thread per connection being served, at most
//     `max_connections`; one more is answered 503 at once and closed, never queued;
//   - limits checked from the headers alone, before a body is read: a body over
//     `max_body_bytes` is 413, a malformed Content-Length 400, a chunked request body 501, an
//     `Expect` other than 100-continue 417; a request (line, headers and body) over
//     `max_header_bytes + max_body_bytes` is 431; each is a JSON error and closes the connection;
//   - Gone(): whether the client of a request in progress has left, so that the router cancels
//     it (httplib tells a handler nothing about its connection);
//   - Shutdown() wakes connections waiting for a request and waits for handlers in progress.
// Errors are `{"error": {"message", "type"}}` like the router's own.
//
// Ownership: the owner keeps the server until Shutdown() (or the destructor) returns; the
// handler must stay callable until then. Threads: the handler (and a stream's producer) runs on
// pool threads, several at once; Shutdown() and port() are thread-safe.
#ifndef PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_
#define PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "pdlib/status.h"

namespace pdlib::router {

struct HttpServerOptions {
  std::string host = "127.0.0.1";                 // an IPv4 or IPv6 literal to bind
  int32_t port = 0;                               // 0 picks a free port; port() tells which
  int max_connections = 256;                      // the thread pool's size
  std::chrono::milliseconds read_timeout{10000};  // for each read while a request arrives
  std::chrono::milliseconds write_timeout{10000};
  std::chrono::milliseconds keep_alive_timeout{5000};  // an idle connection is closed after this
  size_t max_header_bytes = 16 * 1024;                 // request line and headers
  size_t max_body_bytes = 1024 * 1024;
};

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // "/v1/completions", without the query string
  std::string body;
};

// A streamed response body being written. Used by the producer's thread only.
class HttpStream {
 public:
  virtual ~HttpStream() = default;
  // Sends `data` as one chunk. False once the client is gone (nothing more can be sent).
  virtual bool Write(std::string_view data) = 0;
  // Whether the client has closed its end, or the server is shutting down. Does not block.
  virtual bool Gone() = 0;
};

// How a handler answers its request: exactly one of Respond() or Stream(). Used by the
// handler's thread only.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  virtual void Respond(int status, std::string_view content_type, std::string body) = 0;
  // A 200 response whose body `producer` writes, in chunks, once the handler has returned; the
  // producer runs on the same thread and the body ends when it returns.
  virtual void Stream(std::string_view content_type, std::function<void(HttpStream*)> producer) = 0;
  // As HttpStream::Gone(), while the handler is still deciding what to answer.
  virtual bool Gone() = 0;
};

using HttpHandler = std::function<void(const HttpRequest& request, HttpResponder* responder)>;

class HttpServer {
 public:
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                     HttpHandler handler);
  ~HttpServer();  // Shutdown()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting, wakes connections waiting for a request, and waits for every connection
  // (handlers in progress run to their end; Gone() tells them to hurry). Idempotent.
  void Shutdown();
  int32_t port() const;

 private:
  struct Rep;
  explicit HttpServer(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_
