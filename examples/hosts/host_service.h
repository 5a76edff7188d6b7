// HostService: serves a Host (host.h) over gRPC as service Host of
// examples/proto/pd_serving.proto, with the sync API (host_service.cc says why).
//
//   Generate: submits the request; streams a HostToken per generated token (decode), then one
//             HostResult, and ends the stream OK. A failed request is a HostResult with ok=false,
//             the pdlib code and the reason, still on an OK stream: the RPC itself worked.
//   GetLoad:  role, tp/pp, running/queued and, for prefill, the bootstrap address.
//
// A client that cancels only stops its stream: the request runs on (the scheduler has no
// per-request cancel) and its result is dropped. Each open Generate call holds one gRPC thread.
//
// Ownership: the caller owns the service; the Host must outlive it. Shut the Host down first
// (every open stream then gets its result), then the service. Thread-safe. Including this header
// pulls in no gRPC header.
#ifndef PDLIB_EXAMPLES_HOSTS_HOST_SERVICE_H_
#define PDLIB_EXAMPLES_HOSTS_HOST_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "examples/hosts/host.h"
#include "pdlib/status.h"

namespace pdlib::hosts {

struct HostServiceOptions {
  std::string host = "127.0.0.1";  // address to bind
  int32_t port = 0;                // 0 picks a free port; port() tells which
};

class HostService {
 public:
  static StatusOr<std::unique_ptr<HostService>> Start(const HostServiceOptions& options,
                                                      Host* host);
  ~HostService();  // Shutdown()
  HostService(const HostService&) = delete;
  HostService& operator=(const HostService&) = delete;

  // Stops accepting calls and waits up to `grace` for open streams to end, then cancels them.
  // Idempotent.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(1000));
  int32_t port() const;
  std::string address() const;  // "host:port"

 private:
  struct Rep;
  explicit HostService(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_HOST_SERVICE_H_
