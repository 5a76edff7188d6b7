// BootstrapServer: the gRPC service through which a prefill deployment's ranks announce where
// they listen and decode finds them (SPEC R6.1, service Bootstrap in lib/proto/pdlib.proto),
// plus the standard grpc.health.v1 health service.
//
// Runs standalone (tools/pdlib_bootstrap_main.cc) or inside a prefill KVManager. The owner holds
// it by unique_ptr; Start() returns once the server listens, Shutdown() (or the destructor)
// stops it within `shutdown_grace`. Handlers run on gRPC's threads and only convert, validate
// and answer from a BootstrapTable. All methods are thread-safe.
//
// Including this header does not pull in gRPC or protobuf headers.
#ifndef PDLIB_LIB_CONTROL_BOOTSTRAP_SERVER_H_
#define PDLIB_LIB_CONTROL_BOOTSTRAP_SERVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "lib/control/bootstrap_types.h"
#include "lib/control/security.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

inline constexpr int32_t kDefaultBootstrapPort = 8998;

struct BootstrapServerOptions {
  std::string host = "0.0.0.0";          // address to bind
  int32_t port = kDefaultBootstrapPort;  // 0 picks a free port; port() tells which
  // At Shutdown, calls still running get this long before they are cancelled. gRPC also waits
  // up to this long for connected clients to close their connections (an idle client in another
  // process may not read the GOAWAY at once), so Shutdown often takes about this long.
  std::chrono::milliseconds shutdown_grace{250};
  ControlSecurity security;  // shared secret and TLS (security.h)
};

class BootstrapServer {
 public:
  // Validates the options, binds host:port and starts serving. UNAVAILABLE when the address
  // cannot be bound (e.g. the port is taken: the socket is opened without SO_REUSEPORT so that
  // two servers never share a port).
  static StatusOr<std::unique_ptr<BootstrapServer>> Start(const BootstrapServerOptions& options);

  BootstrapServer(const BootstrapServer&) = delete;
  BootstrapServer& operator=(const BootstrapServer&) = delete;
  ~BootstrapServer();  // Shutdown()

  // Marks the health service NOT_SERVING, stops accepting calls and waits (at most
  // shutdown_grace, then cancels) for running calls. Idempotent.
  void Shutdown();

  const std::string& host() const;
  int32_t port() const;         // the bound port, also when options.port was 0
  std::string address() const;  // "host:port"

  // Number of prefill ranks currently registered.
  int32_t ranks_registered() const;

  // The gRPC service name the health service reports on besides "" (the whole server).
  static const char* ServiceName();

 private:
  struct Rep;
  explicit BootstrapServer(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_BOOTSTRAP_SERVER_H_
