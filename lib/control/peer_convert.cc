#include "lib/control/peer_convert.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/control/grpc_status.h"
#include "lib/control/proto_convert.h"

namespace pdlib {
inline namespace v1 {
namespace control {
namespace {

// Far above any real model (layers x K/V x NICs), low enough that a hostile Register cannot make
// prefill import millions of regions.
constexpr int kMaxRegions = 1 << 14;
constexpr int kMaxIndices = 1 << 22;

void RegionsToProto(const std::vector<RegionDesc>& in,
                    google::protobuf::RepeatedPtrField<wire::v1::RegionDesc>* out) {
  for (const RegionDesc& d : in) {
    auto* r = out->Add();
    r->set_addr(d.addr);
    r->set_length(d.length);
    r->set_item_len(d.item_len);
    r->set_key(d.key.data(), d.key.size());
  }
}

Status RegionsFromProto(const google::protobuf::RepeatedPtrField<wire::v1::RegionDesc>& in,
                        const char* what, std::vector<RegionDesc>* out) {
  if (in.size() > kMaxRegions) {
    return Status::InvalidArgument(
        absl::StrFormat("Register: %d %s regions (at most %d)", in.size(), what, kMaxRegions));
  }
  for (int i = 0; i < in.size(); ++i) {
    const auto& r = in[i];
    if (r.item_len() == 0 || r.item_len() > r.length() || r.addr() == 0 ||
        r.addr() > UINT64_MAX - r.length()) {
      return Status::InvalidArgument(
          absl::StrFormat("Register: %s region %d is malformed (addr %#x, length %d, item_len %d)",
                          what, i, r.addr(), r.length(), r.item_len()));
    }
    out->push_back(
        RegionDesc{r.addr(), r.length(), r.item_len(), spi::Blob(r.key().begin(), r.key().end())});
  }
  return Status::OK();
}

void FamiliesToProto(const std::vector<StateFamilyExtent>& in,
                     google::protobuf::RepeatedPtrField<wire::v1::StateFamily>* out) {
  for (const StateFamilyExtent& f : in) {
    wire::v1::StateFamily* w = out->Add();
    w->set_type(static_cast<wire::v1::StateType>(f.type));
    w->set_start(f.start);
    w->set_count(f.count);
  }
}

// Kinds this version knows, starts and counts that cannot overflow; shapes are the planner's.
Status FamiliesFromProto(const google::protobuf::RepeatedPtrField<wire::v1::StateFamily>& in,
                         const char* what, std::vector<StateFamilyExtent>* out) {
  if (in.size() > kMaxRegions) {
    return Status::InvalidArgument(
        absl::StrFormat("%s: %d state families (at most %d)", what, in.size(), kMaxRegions));
  }
  for (int i = 0; i < in.size(); ++i) {
    const wire::v1::StateFamily& f = in[i];
    if (!wire::v1::StateType_IsValid(f.type()) || f.type() == wire::v1::STATE_TYPE_NONE) {
      return Status::InvalidArgument(
          absl::StrFormat("%s: state family %d has state type %d", what, i, f.type()));
    }
    if (f.start() < 0 || f.count() < 0 || f.count() > kMaxRegions) {
      return Status::InvalidArgument(absl::StrFormat(
          "%s: state family %d starts at %d with %d buffers", what, i, f.start(), f.count()));
    }
    out->push_back({static_cast<StateType>(f.type()), f.start(), f.count()});
  }
  return Status::OK();
}

}  // namespace

void ToProto(const RegisterMsg& in, wire::v1::Register* out) {
  ToProto(in.parallel, out->mutable_decode_rank());
  out->set_session_id(in.session);
  ToProto(in.fingerprint, out->mutable_fingerprint());
  out->set_page_size(in.page_size);
  out->set_transport(in.transport);
  out->set_transport_endpoint(in.endpoint.data(), in.endpoint.size());
  RegionsToProto(in.kv, out->mutable_kv_regions());
  RegionsToProto(in.aux, out->mutable_aux_regions());
  RegionsToProto(in.state, out->mutable_state_regions());
  FamiliesToProto(in.state_families, out->mutable_state_families());
  out->set_kv_head_num(in.kv_head_num);
  out->set_kv_layout(in.kv_layout == KVLayout::kNHD ? wire::v1::KV_LAYOUT_NHD
                                                    : wire::v1::KV_LAYOUT_HND);
  out->set_is_mla(in.is_mla);
  out->set_start_layer(in.start_layer);
  out->mutable_state_dim_per_tensor()->Add(in.state_dim_per_tensor.begin(),
                                           in.state_dim_per_tensor.end());
  out->mutable_state_item_rows()->Add(in.state_item_rows.begin(), in.state_item_rows.end());
  out->mutable_state_split_units()->Add(in.state_split_units.begin(), in.state_split_units.end());
  out->set_direction(in.direction == TransferDirection::kPull ? wire::v1::TRANSFER_DIRECTION_PULL
                                                              : wire::v1::TRANSFER_DIRECTION_PUSH);
}

StatusOr<RegisterMsg> FromProto(const wire::v1::Register& in) {
  RegisterMsg out;
  out.parallel = FromProto(in.decode_rank());
  out.session = in.session_id();
  out.fingerprint = FromProto(in.fingerprint());
  out.page_size = in.page_size();
  out.transport = in.transport();
  out.endpoint.assign(in.transport_endpoint().begin(), in.transport_endpoint().end());
  if (Status s = RegionsFromProto(in.kv_regions(), "kv", &out.kv); !s.ok()) return s;
  if (Status s = RegionsFromProto(in.aux_regions(), "aux", &out.aux); !s.ok()) return s;
  if (Status s = RegionsFromProto(in.state_regions(), "state", &out.state); !s.ok()) return s;
  if (in.state_type() != wire::v1::STATE_TYPE_NONE || in.state_start() != 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "Register: state_type %d / state_start %d are wire version 2 fields (version 3 sends "
        "state_families)",
        in.state_type(), in.state_start()));
  }
  if (Status s = FamiliesFromProto(in.state_families(), "Register", &out.state_families); !s.ok()) {
    return s;
  }
  // Shapes are checked by prefill's planner; here only what would be unsafe to hold.
  if (!wire::v1::KVLayout_IsValid(in.kv_layout())) {
    return Status::InvalidArgument(absl::StrFormat("Register: kv_layout %d", in.kv_layout()));
  }
  if (in.kv_head_num() < 0 || in.start_layer() < 0) {
    return Status::InvalidArgument(
        absl::StrFormat("Register: kv_head_num %d, start_layer %d (neither may be negative)",
                        in.kv_head_num(), in.start_layer()));
  }
  for (int n :
       {in.state_dim_per_tensor_size(), in.state_item_rows_size(), in.state_split_units_size()}) {
    if (n > kMaxRegions) {
      return Status::InvalidArgument(
          absl::StrFormat("Register: %d state shape entries (at most %d)", n, kMaxRegions));
    }
  }
  out.kv_head_num = in.kv_head_num();
  out.kv_layout = in.kv_layout() == wire::v1::KV_LAYOUT_NHD ? KVLayout::kNHD : KVLayout::kHND;
  out.is_mla = in.is_mla();
  out.start_layer = in.start_layer();
  out.state_dim_per_tensor.assign(in.state_dim_per_tensor().begin(),
                                  in.state_dim_per_tensor().end());
  out.state_item_rows.assign(in.state_item_rows().begin(), in.state_item_rows().end());
  out.state_split_units.assign(in.state_split_units().begin(), in.state_split_units().end());
  if (!wire::v1::TransferDirection_IsValid(in.direction())) {
    return Status::InvalidArgument(absl::StrFormat("Register: direction %d", in.direction()));
  }
  out.direction = in.direction() == wire::v1::TRANSFER_DIRECTION_PULL ? TransferDirection::kPull
                                                                      : TransferDirection::kPush;
  return out;
}

void ToProto(const RegisterAckMsg& in, wire::v1::RegisterAck* out) {
  out->set_ok(in.status.ok());
  out->set_error_code(static_cast<int>(in.status.code()));
  out->set_error_message(std::string(in.status.message()));
  out->set_transport_reply(in.reply.data(), in.reply.size());
  out->mutable_prefill_rank()->set_tp_rank(in.prefill_tp_rank);
  out->mutable_prefill_rank()->set_pp_rank(in.prefill_pp_rank);
  out->set_stage_start_layer(in.start_layer);
  out->set_stage_num_layers(in.num_layers);
  FamiliesToProto(in.state_families, out->mutable_stage_state_families());
  out->set_session_id(in.instance);
  out->mutable_drained_rooms()->Add(in.drained_rooms.begin(), in.drained_rooms.end());
  if (in.source) ToProto(*in.source, out->mutable_source());
  out->set_lease_ms(in.lease_ms);
}

RegisterAckMsg FromProto(const wire::v1::RegisterAck& in) {
  RegisterAckMsg out;
  if (!in.ok()) {
    StatusCode code = StatusCodeFromInt(in.error_code());
    if (code == StatusCode::kOk) code = StatusCode::kUnknown;
    out.status = Status(code, in.error_message());
  }
  out.reply.assign(in.transport_reply().begin(), in.transport_reply().end());
  out.prefill_tp_rank = in.prefill_rank().tp_rank();
  out.prefill_pp_rank = in.prefill_rank().pp_rank();
  out.start_layer = in.stage_start_layer();
  out.num_layers = in.stage_num_layers();
  // An ack whose families are malformed is a broken peer: decode's coverage check then refuses
  // the stage (its family count differs from decode's).
  if (Status s = FamiliesFromProto(in.stage_state_families(), "RegisterAck", &out.state_families);
      !s.ok()) {
    out.state_families.clear();
    if (out.status.ok()) out.status = s;
  }
  out.instance = in.session_id();
  // Bounded like every index list; a longer one is cut (those rooms stay quarantined).
  const int drained = std::min(in.drained_rooms_size(), kMaxIndices);
  out.drained_rooms.assign(in.drained_rooms().begin(), in.drained_rooms().begin() + drained);
  if (in.has_source()) {
    // Prefill's own description (pull): validated like a Register; a malformed one refuses the
    // connection.
    auto source = FromProto(in.source());
    if (source.ok()) {
      out.source = std::move(*source);
    } else if (out.status.ok()) {
      out.status = source.status().WithPrefix("RegisterAck's source");
    }
  }
  out.lease_ms = in.lease_ms();
  return out;
}

void ToProto(const PullConnectMsg& in, wire::v1::PullConnect* out) {
  out->set_transport_reply(in.reply.data(), in.reply.size());
}

PullConnectMsg FromProto(const wire::v1::PullConnect& in, uint64_t session) {
  return {session, spi::Blob(in.transport_reply().begin(), in.transport_reply().end())};
}

void ToProto(const ReadsDoneMsg& in, wire::v1::ReadsDone* out) {
  out->set_room(in.room);
  out->set_ok(in.status.ok());
  out->set_error_code(static_cast<int>(in.status.code()));
  out->set_reason(std::string(in.status.message()).substr(0, 4096));
}

ReadsDoneMsg FromProto(const wire::v1::ReadsDone& in, uint64_t session) {
  ReadsDoneMsg out;
  out.room = in.room();
  out.session = session;
  if (!in.ok()) {
    StatusCode code = StatusCodeFromInt(in.error_code());
    if (code == StatusCode::kOk) code = StatusCode::kUnknown;
    out.status = Status(code, in.reason().empty() ? "decode's reads failed" : in.reason());
  }
  return out;
}

void ToProto(const HeartbeatMsg& in, wire::v1::Heartbeat* out) {
  out->mutable_rooms()->Add(in.rooms.begin(), in.rooms.end());
}

StatusOr<HeartbeatMsg> FromProto(const wire::v1::Heartbeat& in, uint64_t session) {
  if (in.rooms_size() > kMaxIndices) {
    return Status::InvalidArgument(
        absl::StrFormat("Heartbeat with %d rooms (at most %d)", in.rooms_size(), kMaxIndices));
  }
  return HeartbeatMsg{session, {in.rooms().begin(), in.rooms().end()}};
}

void DigestToProto(const KvDigest& in, wire::v1::KvDigest* out) {
  out->set_page_group(in.page_group);
  out->mutable_kv()->Add(in.kv.begin(), in.kv.end());
  out->mutable_pages()->Add(in.pages.begin(), in.pages.end());
  out->mutable_aux()->Add(in.aux.begin(), in.aux.end());
  out->mutable_state()->Add(in.state.begin(), in.state.end());
  out->set_aux_row_plus_one(in.aux_row + 1);
  for (const auto& [first, count] : in.state_spans) {
    out->add_state_span_first(first);
    out->add_state_span_count(count);
  }
}

// Sizes bounded here; the shape is checked against decode's own where it is used.
StatusOr<KvDigest> DigestFromProto(const wire::v1::KvDigest& in) {
  if (in.kv_size() > kMaxRegions || in.aux_size() > kMaxRegions || in.state_size() > kMaxRegions ||
      in.pages_size() > static_cast<int>(kMaxDigestColumns) ||
      in.state_span_first_size() > kMaxRegions ||
      in.state_span_first_size() != in.state_span_count_size() || in.page_group() == 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "a KV digest of %d KV, %d page, %d aux, %d state entries, %d/%d state spans, %d pages "
        "per column",
        in.kv_size(), in.pages_size(), in.aux_size(), in.state_size(), in.state_span_first_size(),
        in.state_span_count_size(), in.page_group()));
  }
  KvDigest out;
  out.page_group = in.page_group();
  out.kv.assign(in.kv().begin(), in.kv().end());
  out.pages.assign(in.pages().begin(), in.pages().end());
  out.aux.assign(in.aux().begin(), in.aux().end());
  out.state.assign(in.state().begin(), in.state().end());
  if (in.aux_row_plus_one() < 0 || in.aux_row_plus_one() > (int64_t{1} << 32)) {
    return Status::InvalidArgument(
        absl::StrFormat("a KV digest of metadata slot %d", in.aux_row_plus_one() - 1));
  }
  out.aux_row = in.aux_row_plus_one() - 1;
  for (int f = 0; f < in.state_span_first_size(); ++f) {
    out.state_spans.emplace_back(in.state_span_first(f), in.state_span_count(f));
  }
  return out;
}

void ToProto(const ReadReadyMsg& in, wire::v1::ReadReady* out) {
  out->set_room(in.room);
  out->set_prefill_tp_rank(in.prefill_tp_rank);
  out->set_prefill_pp_rank(in.prefill_pp_rank);
  out->mutable_src_pages()->Add(in.src_pages.begin(), in.src_pages.end());
  out->set_src_offset(in.src_offset);
  out->set_last(in.last);
  out->set_layer_begin(in.layer_begin);
  out->set_layer_end(in.layer_end);
  if (in.aux_index) out->set_aux_index(static_cast<int32_t>(*in.aux_index));
  out->mutable_state_indices()->Add(in.state_indices.begin(), in.state_indices.end());
  out->mutable_state_counts()->Add(in.state_counts.begin(), in.state_counts.end());
  if (in.digest) DigestToProto(*in.digest, out->mutable_digest());
}

StatusOr<ReadReadyMsg> FromProto(const wire::v1::ReadReady& in) {
  if (in.src_pages_size() > kMaxIndices || in.state_indices_size() > kMaxIndices ||
      in.state_counts_size() > kMaxRegions) {
    return Status::InvalidArgument(absl::StrFormat(
        "room %d: ReadReady with %d pages, %d state indices, %d state counts", in.room(),
        in.src_pages_size(), in.state_indices_size(), in.state_counts_size()));
  }
  if (in.layer_begin() < 0 || in.layer_end() < in.layer_begin()) {
    return Status::InvalidArgument(absl::StrFormat("room %d: ReadReady for layers [%d, %d)",
                                                   in.room(), in.layer_begin(), in.layer_end()));
  }
  if (in.has_aux_index() && in.aux_index() < 0) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: ReadReady aux index %d is negative", in.room(), in.aux_index()));
  }
  if (in.src_offset() > (uint64_t{1} << 40)) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: ReadReady at page %d", in.room(), in.src_offset()));
  }
  uint64_t counted = 0;
  for (uint32_t c : in.state_counts()) counted += c;
  if (in.state_counts_size() > 0 && counted != static_cast<uint64_t>(in.state_indices_size())) {
    return Status::InvalidArgument(
        absl::StrFormat("room %d: ReadReady state counts add up to %d for %d state indices",
                        in.room(), counted, in.state_indices_size()));
  }
  ReadReadyMsg out;
  out.room = in.room();
  out.prefill_tp_rank = in.prefill_tp_rank();
  out.prefill_pp_rank = in.prefill_pp_rank();
  out.src_pages.assign(in.src_pages().begin(), in.src_pages().end());
  out.src_offset = in.src_offset();
  out.last = in.last();
  out.layer_begin = in.layer_begin();
  out.layer_end = in.layer_end();
  if (in.has_aux_index()) out.aux_index = static_cast<uint32_t>(in.aux_index());
  out.state_indices.assign(in.state_indices().begin(), in.state_indices().end());
  out.state_counts.assign(in.state_counts().begin(), in.state_counts().end());
  if (in.has_digest()) {
    auto digest = DigestFromProto(in.digest());
    if (!digest.ok()) return digest.status().WithPrefix(absl::StrFormat("room %d", in.room()));
    out.digest = std::move(*digest);
  }
  return out;
}

void ToProto(const RoomsDrainedMsg& in, wire::v1::Drained* out) {
  out->set_instance(in.instance);
  out->mutable_rooms()->Add(in.rooms.begin(), in.rooms.end());
  out->set_prefill_tp_rank(in.prefill_tp_rank);
  out->set_prefill_pp_rank(in.prefill_pp_rank);
}

StatusOr<RoomsDrainedMsg> FromProto(const wire::v1::Drained& in) {
  if (in.rooms_size() > kMaxIndices) {
    return Status::InvalidArgument(
        absl::StrFormat("Drained with %d rooms (at most %d)", in.rooms_size(), kMaxIndices));
  }
  if (in.instance() == 0) return Status::InvalidArgument("Drained without a prefill instance");
  RoomsDrainedMsg out;
  out.instance = in.instance();
  out.rooms.assign(in.rooms().begin(), in.rooms().end());
  out.prefill_tp_rank = in.prefill_tp_rank();
  out.prefill_pp_rank = in.prefill_pp_rank();
  return out;
}

void ToProto(const TransferInfoMsg& in, wire::v1::TransferInfo* out) {
  out->set_room(in.room);
  out->mutable_dst_kv_pages()->Add(in.dst_kv_pages.begin(), in.dst_kv_pages.end());
  if (in.aux_index) out->set_aux_index(static_cast<int32_t>(*in.aux_index));
  out->mutable_dst_state_indices()->Add(in.dst_state_indices.begin(), in.dst_state_indices.end());
  out->mutable_dst_state_counts()->Add(in.dst_state_counts.begin(), in.dst_state_counts.end());
  out->set_required_dst_info_num(in.required_dst_info_num);
  out->set_is_dummy(in.is_dummy);
  out->set_decode_prefix_len(in.decode_prefix_len);
}

StatusOr<TransferInfoMsg> FromProto(const wire::v1::TransferInfo& in, uint64_t session) {
  if (in.dst_kv_pages_size() > kMaxIndices || in.dst_state_indices_size() > kMaxIndices) {
    return Status::InvalidArgument(absl::StrFormat(
        "room %d: TransferInfo with %d pages and %d state indices (at most %d each)", in.room(),
        in.dst_kv_pages_size(), in.dst_state_indices_size(), kMaxIndices));
  }
  if (in.has_aux_index() && in.aux_index() < 0) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: aux index %d is negative", in.room(), in.aux_index()));
  }
  TransferInfoMsg out;
  out.room = in.room();
  out.session = session;
  out.dst_kv_pages.assign(in.dst_kv_pages().begin(), in.dst_kv_pages().end());
  if (in.has_aux_index()) out.aux_index = static_cast<uint32_t>(in.aux_index());
  out.dst_state_indices.assign(in.dst_state_indices().begin(), in.dst_state_indices().end());
  if (in.dst_state_counts_size() > kMaxRegions) {
    return Status::InvalidArgument(
        absl::StrFormat("room %d: TransferInfo with %d state families (at most %d)", in.room(),
                        in.dst_state_counts_size(), kMaxRegions));
  }
  uint64_t counted = 0;
  for (uint32_t c : in.dst_state_counts()) counted += c;
  if (in.dst_state_counts_size() > 0 && counted != out.dst_state_indices.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("room %d: TransferInfo state counts add up to %d for %d state indices",
                        in.room(), counted, out.dst_state_indices.size()));
  }
  out.dst_state_counts.assign(in.dst_state_counts().begin(), in.dst_state_counts().end());
  out.required_dst_info_num = in.required_dst_info_num();
  out.is_dummy = in.is_dummy();
  out.decode_prefix_len = in.decode_prefix_len();
  return out;
}

void ToProto(const TransferStatusMsg& in, wire::v1::TransferStatus* out) {
  out->set_room(in.room);
  out->set_result(in.status.ok() ? wire::v1::TRANSFER_RESULT_SUCCESS
                                 : wire::v1::TRANSFER_RESULT_FAILED);
  out->set_prefill_tp_rank(in.prefill_tp_rank);
  out->set_prefill_pp_rank(in.prefill_pp_rank);
  out->set_error_code(static_cast<int>(in.status.code()));
  out->set_reason(std::string(in.status.message()));
  if (in.digest) DigestToProto(*in.digest, out->mutable_digest());
}

StatusOr<TransferStatusMsg> FromProto(const wire::v1::TransferStatus& in) {
  TransferStatusMsg out;
  out.room = in.room();
  out.prefill_tp_rank = in.prefill_tp_rank();
  out.prefill_pp_rank = in.prefill_pp_rank();
  switch (in.result()) {
    case wire::v1::TRANSFER_RESULT_SUCCESS: break;
    case wire::v1::TRANSFER_RESULT_FAILED: {
      StatusCode code = StatusCodeFromInt(in.error_code());
      if (code == StatusCode::kOk) code = StatusCode::kUnknown;
      out.status = Status(code, in.reason().empty() ? "prefill reported failure" : in.reason());
      break;
    }
    default:
      return Status::InvalidArgument(
          absl::StrFormat("room %d: TransferStatus without a result", in.room()));
  }
  if (in.has_digest()) {
    auto digest = DigestFromProto(in.digest());
    if (!digest.ok()) return digest.status().WithPrefix(absl::StrFormat("room %d", in.room()));
    out.digest = std::move(*digest);
  }
  return out;
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
