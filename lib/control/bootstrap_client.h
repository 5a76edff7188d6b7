// BootstrapClient: talks to one bootstrap server (SPEC R6.1) with a deadline on every call.
//
// Prefill ranks call RegisterRank, which retries with exponential backoff (and jitter) while the
// server is unreachable, so a prefill rank may start before its bootstrap server. Decode calls
// GetParallelInfo and GetRankAddress, which do not retry: decode decides what to do with a
// failure. Errors keep gRPC's code and name the server ("bootstrap 10.0.0.1:8998 unreachable:
// ...").
//
// Thread-safe: any thread may call any method, concurrently. Cancel() makes every running and
// later call return CANCELLED promptly (for shutdown). Including this header does not pull in
// gRPC or protobuf headers.
#ifndef PDLIB_LIB_CONTROL_BOOTSTRAP_CLIENT_H_
#define PDLIB_LIB_CONTROL_BOOTSTRAP_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lib/control/bootstrap_types.h"
#include "lib/control/security.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

struct BootstrapClientOptions {
  // Deadline of one attempt of any call.
  std::chrono::milliseconds rpc_timeout{5000};
  // RegisterRank retries UNAVAILABLE and DEADLINE_EXCEEDED until this much time has passed
  // since it was called, or until register_max_attempts attempts (0: no limit on attempts).
  std::chrono::milliseconds register_deadline{60000};
  int32_t register_max_attempts = 0;
  // Pause after the first failed attempt; each further pause is backoff_multiplier times
  // longer, capped at max_backoff, and randomised by +-20%.
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{2000};
  double backoff_multiplier = 2.0;
  ControlSecurity security;  // shared secret and TLS (security.h)
};

class BootstrapClient {
 public:
  // Validates host, port and options. The connection is made lazily by the first call, so this
  // succeeds while the server is still down.
  static StatusOr<std::unique_ptr<BootstrapClient>> Create(std::string_view host, int32_t port,
                                                           const BootstrapClientOptions& options);
  static StatusOr<std::unique_ptr<BootstrapClient>> Create(std::string_view host, int32_t port) {
    return Create(host, port, BootstrapClientOptions{});
  }

  BootstrapClient(const BootstrapClient&) = delete;
  BootstrapClient& operator=(const BootstrapClient&) = delete;
  // Must not run while a call is running on another thread (Cancel() and join first).
  ~BootstrapClient();

  // Registers a prefill rank, retrying while the server is unreachable (see options). Errors
  // the server answered with (INVALID_ARGUMENT, FAILED_PRECONDITION) are returned at once.
  StatusOr<RegisterResult> RegisterRank(const RankRegistration& registration);

  // Withdraws a rank registered at host:port; true when it was registered there. No retry.
  StatusOr<bool> UnregisterRank(const RankId& id, std::string_view host, uint32_t port);

  // NOT_FOUND while no prefill rank has registered.
  StatusOr<ParallelInfo> GetParallelInfo();

  // INVALID_ARGUMENT when out of range of the registered sizes, NOT_FOUND when not registered.
  StatusOr<RankAddress> GetRankAddress(const RankId& id);

  // The room-failure relay (bootstrap_table.h): prefill reports, decode asks.
  Status ReportRoomFailures(const std::vector<RoomFailure>& failures);
  StatusOr<std::vector<RoomFailure>> GetRoomFailures(const std::vector<uint64_t>& rooms);

  // OK when the server's grpc.health.v1 service reports SERVING for `service` ("" is the whole
  // server); UNAVAILABLE naming the reported status otherwise.
  Status CheckHealth(std::string_view service = "");

  // Makes running and later calls return CANCELLED. Irreversible.
  void Cancel();

  const std::string& address() const;  // "host:port"

 private:
  struct Rep;
  explicit BootstrapClient(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_BOOTSTRAP_CLIENT_H_
