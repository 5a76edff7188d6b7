// Router: the pd-router process in a library (issue #8). It serves service Router of
// examples/proto/pd_serving.proto over gRPC and /v1/completions over HTTP/JSON, and runs each
// request on a prefill and a decode host (service Host) picked by its policy (core.h).
//
//   auto router = Router::Start(options);   // waits until every host answered GetLoad
//   ... (*router)->grpc_port(), (*router)->http_port() ...
//   (*router)->Shutdown();                  // cancels requests in flight, stops serving
//
// HTTP endpoints: POST /v1/completions (completions.h), GET /health (200 "ok"), GET /metrics
// (Prometheus text). gRPC: Router.Generate streams GenerateEvents: each token, then one
// GenerateResult; a request that fails after it was dispatched ends with a GenerateResult whose
// ok is false and whose reason names the failing host, and the RPC status is OK. An invalid
// request (empty prompt, negative ids or max_new_tokens) ends with INVALID_ARGUMENT and no
// result; a router that is shutting down answers UNAVAILABLE.
//
// Ownership: the caller owns the router. Threads: all methods are thread-safe. Including this
// header pulls in no gRPC header.
#ifndef PDLIB_EXAMPLES_ROUTER_ROUTER_H_
#define PDLIB_EXAMPLES_ROUTER_ROUTER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "examples/router/policy.h"
#include "pdlib/status.h"

namespace pdlib::router {

struct RouterOptions {
  std::string host = "127.0.0.1";          // address both servers bind
  int32_t port = 0;                        // gRPC Router service; 0 picks a free port
  int32_t http_port = 0;                   // HTTP/JSON; 0 picks a free port, -1 turns HTTP off
  std::vector<std::string> prefill_hosts;  // host:port of each prefill host's Host service
  std::vector<std::string> decode_hosts;
  Policy policy = Policy::kPowerOfTwo;
  int32_t default_max_new_tokens = 16;  // for requests that do not say
  std::optional<uint64_t> seed;         // policies and rooms; unset: from std::random_device
  std::chrono::milliseconds request_timeout{60000};     // per request, both hosts' RPCs
  std::chrono::milliseconds startup_timeout{30000};     // for every host to answer GetLoad
  std::chrono::milliseconds load_poll_interval{500};    // GetLoad refresh
  std::chrono::milliseconds unavailable_backoff{5000};  // skip a host after UNAVAILABLE
  std::chrono::milliseconds settle_time{500};           // see core.h
  size_t max_http_body_bytes = 1024 * 1024;
  int max_http_connections = 256;
  // Startup progress ("waiting for 1 host(s): ..."), about once a second; may be null.
  std::function<void(const std::string&)> progress;
};

class Router {
 public:
  static StatusOr<std::unique_ptr<Router>> Start(const RouterOptions& options);
  ~Router();  // Shutdown()
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Fails requests in flight with UNAVAILABLE, stops both servers, waits for every request and
  // connection to end. Idempotent.
  void Shutdown();

  int32_t grpc_port() const;
  int32_t http_port() const;  // -1 when HTTP is off
  // What GET /metrics returns.
  std::string MetricsText() const;

 private:
  struct Rep;
  explicit Router(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_ROUTER_H_
