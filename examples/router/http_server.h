// HttpServer: a minimal HTTP/1.1 server on a TCP socket, enough for the router's JSON API and
// curl: one accept thread and one thread per connection, one request per connection (http.h).
// Debian ships no HTTP server library the project uses, and the router needs very little.
//
// Bounds: at most `max_connections` connections at once (more get 503 and are closed); a client
// has `read_timeout` to send its whole request (else 408); writes give up after `write_timeout`;
// the header block and body are limited by `limits`.
//
// Ownership: the owner keeps the server until Shutdown() (or the destructor) returns; the
// handler must stay callable until then. Threads: the handler runs on connection threads, several
// at once; Shutdown() and port() are thread-safe.
#ifndef PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_
#define PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "examples/router/http.h"
#include "pdlib/status.h"

namespace pdlib::router {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // an IPv4 or IPv6 literal to bind
  int32_t port = 0;                // 0 picks a free port; port() tells which
  int max_connections = 256;
  std::chrono::milliseconds read_timeout{10000};
  std::chrono::milliseconds write_timeout{10000};
  HttpLimits limits;
};

// The connection a handler answers on. Used by the connection's thread only.
class HttpConnection {
 public:
  // A whole response. False when the client is gone (nothing more can be sent).
  bool Respond(int status, std::string_view content_type, std::string_view body);
  // A response whose body runs until the connection closes (server-sent events).
  bool StartStream(int status, std::string_view content_type);
  bool SendStreamData(std::string_view data);
  // Whether the client has closed its end, or the server is shutting down. Does not block.
  bool Gone();
  bool responded() const { return responded_; }

 private:
  friend class HttpServer;
  HttpConnection(int fd, int wake_fd, std::chrono::milliseconds write_timeout)
      : fd_(fd), wake_fd_(wake_fd), write_timeout_(write_timeout) {}
  bool SendAll(std::string_view data);

  const int fd_;
  const int wake_fd_;
  const std::chrono::milliseconds write_timeout_;
  bool responded_ = false;
  bool broken_ = false;
};

using HttpHandler = std::function<void(const HttpRequest& request, HttpConnection* connection)>;

class HttpServer {
 public:
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                     HttpHandler handler);
  ~HttpServer();  // Shutdown()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting, wakes connections waiting for a request, and waits for every connection
  // thread (handlers in progress run to their end). Idempotent.
  void Shutdown();
  int32_t port() const;

 private:
  struct Rep;
  explicit HttpServer(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_HTTP_SERVER_H_
