// Conversions between pdlib::Status and grpc::Status. Both number their codes like
// google/rpc/code.proto, so codes map one to one and messages pass through unchanged.
#ifndef PDLIB_LIB_CONTROL_GRPC_STATUS_H_
#define PDLIB_LIB_CONTROL_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string_view>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

// A code outside google.rpc.Code's range (a newer or buggy peer) becomes kUnknown, with the
// number kept in the message.
StatusCode StatusCodeFromInt(int code);

Status FromGrpcStatus(const grpc::Status& status);
grpc::Status ToGrpcStatus(const Status& status);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_GRPC_STATUS_H_
