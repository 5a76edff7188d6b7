#include "lib/control/grpc_status.h"

#include <string>

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {
constexpr int kMaxStatusCode = static_cast<int>(StatusCode::kUnauthenticated);
}  // namespace

StatusCode StatusCodeFromInt(int code) {
  if (code < 0 || code > kMaxStatusCode) return StatusCode::kUnknown;
  return static_cast<StatusCode>(code);
}

Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return Status::OK();
  const int raw = static_cast<int>(status.error_code());
  const StatusCode code = StatusCodeFromInt(raw);
  if (code == StatusCode::kUnknown && raw != static_cast<int>(StatusCode::kUnknown)) {
    return Status(code, absl::StrFormat("(gRPC code %d) %s", raw, status.error_message()));
  }
  return Status(code, status.error_message());
}

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
