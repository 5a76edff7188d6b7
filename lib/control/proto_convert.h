// Conversions between the generated wire messages (lib/proto/pdlib.proto, namespace
// pdlib::wire::v1) and pdlib's plain structs. Conversions from the wire copy fields only; the
// receiver validates the result (e.g. ValidateRankRegistration) before using it.
#ifndef PDLIB_LIB_CONTROL_PROTO_CONVERT_H_
#define PDLIB_LIB_CONTROL_PROTO_CONVERT_H_

#include "lib/control/bootstrap_types.h"
#include "lib/proto/pdlib.pb.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

void ToProto(const ModelFingerprint& in, wire::v1::ModelFingerprint* out);
ModelFingerprint FromProto(const wire::v1::ModelFingerprint& in);

void ToProto(const ParallelConfig& in, wire::v1::RankInfo* out);
ParallelConfig FromProto(const wire::v1::RankInfo& in);

void ToProto(const RankRegistration& in, wire::v1::RegisterRankRequest* out);
// INVALID_ARGUMENT when the role is not ROLE_PREFILL (the only role that registers).
StatusOr<RankRegistration> FromProto(const wire::v1::RegisterRankRequest& in);

void ToProto(const RegisterResult& in, wire::v1::RegisterRankResponse* out);
RegisterResult FromProto(const wire::v1::RegisterRankResponse& in);

void ToProto(const ParallelInfo& in, wire::v1::GetParallelInfoResponse* out);
ParallelInfo FromProto(const wire::v1::GetParallelInfoResponse& in);

void ToProto(const RankId& in, wire::v1::GetRankAddressRequest* out);
RankId FromProto(const wire::v1::GetRankAddressRequest& in);

void ToProto(const RankAddress& in, wire::v1::GetRankAddressResponse* out);
// INVALID_ARGUMENT when the port does not fit [1, 65535] or the host is empty.
StatusOr<RankAddress> FromProto(const wire::v1::GetRankAddressResponse& in);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_PROTO_CONVERT_H_
