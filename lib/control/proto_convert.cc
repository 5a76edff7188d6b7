#include "lib/control/proto_convert.h"

#include <string>

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace pb = ::pdlib::wire::v1;

void ToProto(const ModelFingerprint& in, pb::ModelFingerprint* out) {
  out->set_num_layers(in.num_layers);
  out->set_num_kv_heads(in.num_kv_heads);
  out->set_head_dim(in.head_dim);
  out->set_dtype_bytes(in.dtype_bytes);
  out->set_layout_version(in.layout_version);
  out->set_model_name(in.model_name);
  out->set_kv_dtype(in.kv_dtype);
  out->set_state_dtype(in.state_dtype);
  out->set_page_layout(in.page_layout);
  out->set_engine_tag(in.engine_tag);
  out->set_checksum(in.checksum);
  out->set_wire_version(PDLIB_WIRE_VERSION);  // always this library's, whatever `in` holds
}

ModelFingerprint FromProto(const pb::ModelFingerprint& in) {
  ModelFingerprint out;
  out.num_layers = in.num_layers();
  out.num_kv_heads = in.num_kv_heads();
  out.head_dim = in.head_dim();
  out.dtype_bytes = in.dtype_bytes();
  out.layout_version = in.layout_version();
  out.model_name = in.model_name();
  out.kv_dtype = in.kv_dtype();
  out.state_dtype = in.state_dtype();
  out.page_layout = in.page_layout();
  out.engine_tag = in.engine_tag();
  out.checksum = in.checksum();
  out.wire_version = in.wire_version();
  return out;
}

void ToProto(const ParallelConfig& in, pb::RankInfo* out) {
  out->set_tp_rank(in.tp_rank);
  out->set_dp_rank(in.dp_rank);
  out->set_pp_rank(in.pp_rank);
  out->set_tp_size(in.tp_size);
  out->set_dp_size(in.dp_size);
  out->set_pp_size(in.pp_size);
}

ParallelConfig FromProto(const pb::RankInfo& in) {
  ParallelConfig out;
  out.tp_rank = in.tp_rank();
  out.dp_rank = in.dp_rank();
  out.pp_rank = in.pp_rank();
  out.tp_size = in.tp_size();
  out.dp_size = in.dp_size();
  out.pp_size = in.pp_size();
  return out;
}

void ToProto(const RankRegistration& in, pb::RegisterRankRequest* out) {
  out->set_role(pb::ROLE_PREFILL);
  ToProto(in.parallel, out->mutable_rank());
  out->set_host(in.host);
  out->set_port(in.port);
  out->set_page_size(in.page_size);
  ToProto(in.fingerprint, out->mutable_fingerprint());
}

StatusOr<RankRegistration> FromProto(const pb::RegisterRankRequest& in) {
  if (in.role() != pb::ROLE_PREFILL) {
    const std::string name = pb::Role_Name(in.role());  // empty for a value this build lacks
    return Status::InvalidArgument(
        absl::StrFormat("role %s (%d) cannot register with bootstrap: only ROLE_PREFILL ranks do",
                        name.empty() ? "unknown" : name, static_cast<int>(in.role())));
  }
  if (!in.has_rank()) return Status::InvalidArgument("rank is missing from RegisterRankRequest");
  RankRegistration out;
  out.parallel = FromProto(in.rank());
  out.host = in.host();
  out.port = in.port();
  out.page_size = in.page_size();
  out.fingerprint = FromProto(in.fingerprint());
  return out;
}

void ToProto(const RegisterResult& in, pb::RegisterRankResponse* out) {
  out->set_ranks_registered(in.ranks_registered);
  out->set_ranks_expected(in.ranks_expected);
  out->set_replaced(in.replaced);
  out->set_registration_id(in.registration_id);
}

RegisterResult FromProto(const pb::RegisterRankResponse& in) {
  RegisterResult out;
  out.ranks_registered = in.ranks_registered();
  out.ranks_expected = in.ranks_expected();
  out.replaced = in.replaced();
  out.registration_id = in.registration_id();
  return out;
}

void ToProto(const ParallelInfo& in, pb::GetParallelInfoResponse* out) {
  out->set_tp_size(in.tp_size);
  out->set_dp_size(in.dp_size);
  out->set_pp_size(in.pp_size);
  out->set_page_size(in.page_size);
  ToProto(in.fingerprint, out->mutable_fingerprint());
  out->set_ranks_registered(in.ranks_registered);
  out->set_ranks_expected(in.ranks_expected);
}

ParallelInfo FromProto(const pb::GetParallelInfoResponse& in) {
  ParallelInfo out;
  out.tp_size = in.tp_size();
  out.dp_size = in.dp_size();
  out.pp_size = in.pp_size();
  out.page_size = in.page_size();
  out.fingerprint = FromProto(in.fingerprint());
  out.ranks_registered = in.ranks_registered();
  out.ranks_expected = in.ranks_expected();
  return out;
}

void ToProto(const RankId& in, pb::GetRankAddressRequest* out) {
  out->set_dp_rank(in.dp_rank);
  out->set_tp_rank(in.tp_rank);
  out->set_pp_rank(in.pp_rank);
}

RankId FromProto(const pb::GetRankAddressRequest& in) {
  return RankId{in.dp_rank(), in.tp_rank(), in.pp_rank()};
}

void ToProto(const RankAddress& in, pb::GetRankAddressResponse* out) {
  out->set_host(in.host);
  out->set_port(in.port);
  out->set_registration_id(in.registration_id);
}

StatusOr<RankAddress> FromProto(const pb::GetRankAddressResponse& in) {
  if (in.host().empty()) return Status::InvalidArgument("rank address has an empty host");
  if (in.port() == 0 || in.port() > 65535) {
    return Status::InvalidArgument(
        absl::StrFormat("rank address port %u out of range [1, 65535]", in.port()));
  }
  RankAddress out;
  out.host = in.host();
  out.port = static_cast<uint16_t>(in.port());
  out.registration_id = in.registration_id();
  return out;
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
