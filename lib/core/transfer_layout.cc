#include "lib/core/transfer_layout.h"

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace {

// Opaque KV (see the header): the planner treats each buffer like an MLA layer, one unit per
// page that every TP rank holds, so equal TP ranks pair 1:1 and pages move whole.
Status MakeOpaque(planner::SideLayout* l, const char* side) {
  if (l->pp_size > 1) {
    return Status::InvalidArgument(absl::StrFormat(
        "%s: pipeline parallelism (pp_size %d) needs kv_head_num (or is_mla) in KVArgs", side,
        l->pp_size));
  }
  l->is_mla = true;
  l->opaque_kv = true;
  l->total_layers = static_cast<int32_t>(l->kv.size());
  l->start_layer = 0;
  return Status::OK();
}

bool IsOpaque(int32_t kv_head_num, bool is_mla) { return kv_head_num == 0 && !is_mla; }

}  // namespace

StatusOr<planner::SideLayout> PlannerLayout(const KVArgs& args, const char* side) {
  auto l = planner::SideLayoutFromKVArgs(args);
  if (!l.ok()) return l.status().WithPrefix(side);
  if (IsOpaque(args.kv_head_num, args.is_mla)) {
    if (Status s = MakeOpaque(&*l, side); !s.ok()) return s;
  }
  if (Status s = planner::ValidateSideLayout(*l, side); !s.ok()) return s;
  return l;
}

StatusOr<planner::SideLayout> PlannerLayout(const RegisterMsg& msg, const char* side) {
  planner::SideLayout l;
  l.tp_size = msg.parallel.tp_size;
  l.tp_rank = msg.parallel.tp_rank;
  l.pp_size = msg.parallel.pp_size;
  l.pp_rank = msg.parallel.pp_rank;
  l.total_layers = msg.fingerprint.num_layers;
  l.start_layer = msg.start_layer;
  l.total_kv_heads = msg.fingerprint.num_kv_heads;
  l.kv_heads = msg.kv_head_num;
  l.page_size = msg.page_size;
  l.layout = msg.kv_layout;
  l.is_mla = msg.is_mla;
  for (const RegionDesc& d : msg.kv) l.kv.push_back({d.item_len, d.length});
  for (const RegionDesc& d : msg.aux) l.aux.push_back({d.item_len, d.length});
  if (l.total_layers == 0 && l.pp_size == 1) l.total_layers = l.num_layers();
  for (auto [n, name] : {std::pair{msg.state_dim_per_tensor.size(), "state_dim_per_tensor"},
                         std::pair{msg.state_item_rows.size(), "state_item_rows"},
                         std::pair{msg.state_split_units.size(), "state_split_units"}}) {
    if (n != 0 && n != msg.state.size()) {
      return Status::InvalidArgument(absl::StrFormat(
          "%s Register: %s has %d entries for %d state buffers", side, name, n, msg.state.size()));
    }
  }
  for (size_t i = 0; i < msg.state.size(); ++i) {
    planner::StateBufferDesc s;
    s.item_bytes = msg.state[i].item_len;
    s.buffer_bytes = msg.state[i].length;
    if (!msg.state_dim_per_tensor.empty()) s.split_dim = msg.state_dim_per_tensor[i];
    if (!msg.state_item_rows.empty()) s.rows = msg.state_item_rows[i];
    if (!msg.state_split_units.empty()) s.split_units = msg.state_split_units[i];
    l.state.push_back(s);
  }
  uint32_t first = 0;
  for (const StateFamilyExtent& f : msg.state_families) {
    if (f.count < 0) {
      return Status::InvalidArgument(absl::StrFormat("%s Register: %s state family with %d buffers",
                                                     side, StateTypeName(f.type), f.count));
    }
    l.state_families.push_back({f.type, f.start, first, static_cast<uint32_t>(f.count)});
    first += static_cast<uint32_t>(f.count);
  }
  if (IsOpaque(msg.kv_head_num, msg.is_mla)) {
    if (Status s = MakeOpaque(&l, side); !s.ok()) return s;
  }
  if (Status s = planner::ValidateSideLayout(l, side); !s.ok()) return s;
  return l;
}

RegisterMsg DescribeRank(const KVManagerOptions& options, const planner::SideLayout& layout,
                         const RegisteredBuffers& local, std::string transport, uint64_t session,
                         spi::Blob endpoint) {
  RegisterMsg msg;
  msg.session = session;
  msg.direction = options.direction;
  msg.fingerprint = options.args.fingerprint;
  msg.page_size = options.args.page_size;
  msg.parallel = options.args.parallel;
  msg.transport = std::move(transport);
  msg.endpoint = std::move(endpoint);
  msg.kv = local.kv.descs;
  msg.aux = local.aux.descs;
  msg.state = local.state.descs;
  FillRegisterLayout(options.args, layout, &msg);
  return msg;
}

void AppendReads(std::span<const planner::PlannedWrite> writes, const RegionIds& decode,
                 const RegionIds& prefill, std::vector<spi::ReadOp>* out) {
  out->reserve(out->size() + writes.size());
  for (const planner::PlannedWrite& w : writes) {
    std::span<const uint32_t> mine = decode.kv, theirs = prefill.kv;
    if (w.kind == planner::RegionKind::kAux) {
      mine = decode.aux;
      theirs = prefill.aux;
    } else if (w.kind == planner::RegionKind::kState) {
      mine = decode.state;
      theirs = prefill.state;
    }
    out->push_back(
        {mine[w.remote_buffer], w.remote_offset, theirs[w.local_buffer], w.local_offset, w.length});
  }
}

std::vector<StateFamilyExtent> FamilyExtents(const planner::SideLayout& layout) {
  std::vector<StateFamilyExtent> out;
  for (const planner::StateFamilySpan& f : layout.Families()) {
    out.push_back({f.type, f.start, static_cast<int32_t>(f.count)});
  }
  return out;
}

void FillRegisterLayout(const KVArgs& args, const planner::SideLayout& layout, RegisterMsg* msg) {
  msg->kv_head_num = args.kv_head_num;
  msg->kv_layout = args.kv_layout;
  msg->is_mla = args.is_mla;
  msg->start_layer = args.prefill_start_layer;
  msg->state_families = FamilyExtents(layout);
  // Per-buffer shapes of every family, in the order of the layout's (and the regions') buffers;
  // the defaults are sent only when no buffer differs from them.
  msg->state_dim_per_tensor.clear();
  msg->state_item_rows.clear();
  msg->state_split_units.clear();
  bool split = false, rows = false, units = false;
  for (const planner::StateBufferDesc& b : layout.state) {
    split |= b.split_dim != -1;
    rows |= b.rows != 1;
    units |= b.split_units != 0;
  }
  for (const planner::StateBufferDesc& b : layout.state) {
    if (split) msg->state_dim_per_tensor.push_back(b.split_dim);
    if (rows) msg->state_item_rows.push_back(b.rows);
    if (units) msg->state_split_units.push_back(b.split_units);
  }
}

void FillAckExtent(const planner::SideLayout& prefill, RegisterAckMsg* ack) {
  planner::StageExtent e = planner::ExtentOf(prefill);
  ack->start_layer = e.start_layer;
  ack->num_layers = e.num_layers;
  ack->state_families = FamilyExtents(prefill);
}

planner::StageExtent StageExtentOf(const RegisterAckMsg& ack) {
  planner::StageExtent e{ack.prefill_pp_rank, ack.start_layer, ack.num_layers, {}};
  for (const StateFamilyExtent& f : ack.state_families) e.states.push_back({f.start, f.count});
  return e;
}

Status CheckOpaqueCompatible(int32_t prefill_kv_head_num, int32_t prefill_tp, bool prefill_mla,
                             int32_t decode_kv_head_num, int32_t decode_tp, bool decode_mla) {
  if (prefill_mla != decode_mla) {
    return Status::FailedPrecondition(absl::StrFormat("MLA mismatch: prefill %s, decode %s",
                                                      prefill_mla ? "MLA" : "not MLA",
                                                      decode_mla ? "MLA" : "not MLA"));
  }
  if (prefill_mla) return Status::OK();
  const bool p = IsOpaque(prefill_kv_head_num, false), d = IsOpaque(decode_kv_head_num, false);
  if (p != d) {
    return Status::FailedPrecondition(absl::StrFormat(
        "kv_head_num is %d on prefill and %d on decode: set it on both sides or on neither "
        "(0: opaque pages, equal TP only)",
        prefill_kv_head_num, decode_kv_head_num));
  }
  if (p && prefill_tp != decode_tp) {
    return Status::FailedPrecondition(absl::StrFormat(
        "prefill TP %d -> decode TP %d needs kv_head_num (and kv_layout) in both sides' KVArgs: "
        "without it pages are opaque and move whole between equal TP ranks only",
        prefill_tp, decode_tp));
  }
  return Status::OK();
}

StatusOr<std::vector<PrefillTarget>> PrefillTargetsFor(const planner::SideLayout& decode,
                                                       int32_t decode_kv_head_num,
                                                       bool decode_is_mla, int32_t prefill_tp_size,
                                                       int32_t prefill_pp_size) {
  // Opaque pages move whole: say what to set rather than letting the planner pair the ranks.
  // (A prefill side that disagrees on opaque KV refuses at Register.)
  if (IsOpaque(decode_kv_head_num, decode_is_mla) && prefill_tp_size != decode.tp_size) {
    return CheckOpaqueCompatible(0, prefill_tp_size, false, 0, decode.tp_size, false);
  }
  auto topology = planner::MakeTopology(decode, prefill_tp_size, prefill_pp_size);
  if (!topology.ok()) return topology.status();
  const planner::RankId me{decode.tp_rank, decode.pp_rank};
  auto expected = planner::ExpectedPrefillRanks(*topology, me);
  if (!expected.ok()) return expected.status();
  auto dummies = planner::DummyPrefillRanks(*topology, me);
  if (!dummies.ok()) return dummies.status();
  std::vector<PrefillTarget> out;
  for (const planner::RankId& r : *expected) {
    auto n = planner::RequiredDstInfoNum(*topology, r);
    if (!n.ok()) return n.status();
    out.push_back({r, false, *n});
  }
  for (const planner::RankId& r : *dummies) out.push_back({r, true, 1});
  return out;
}

Status PlanPublishedChunk(const planner::PairPlan& plan, const TransferInfoMsg& info,
                          const ReadReadyMsg& msg, planner::PlanOutput* out, uint64_t* dst_begin,
                          uint64_t* dst_end, bool* final, planner::TailInput* tail_out) {
  const uint64_t prefix_pages = info.decode_prefix_len / plan.page_size;
  const uint64_t total = prefix_pages + info.dst_kv_pages.size();
  const uint64_t begin = msg.src_offset, end = msg.src_offset + msg.src_pages.size();
  *final = msg.last && msg.layer_end == plan.prefill_layers;
  out->writes.clear();
  out->bytes = 0;
  *dst_begin = *dst_end = 0;
  if (end > total || (msg.last && end != total)) {
    return Status::OutOfRange(absl::StrFormat(
        "room %d: prefill published prompt pages [%d, %d)%s; this request has %d (%d after the "
        "prefix)",
        msg.room, begin, end, msg.last ? " as the last chunk" : "", total,
        info.dst_kv_pages.size()));
  }
  if (msg.layer_end > plan.prefill_layers || msg.layer_begin >= msg.layer_end) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: prefill published layers [%d, %d) of its %d", msg.room,
                        msg.layer_begin, msg.layer_end, plan.prefill_layers));
  }
  // The prompt pages decode holds in its prefix are not read.
  const uint64_t skip =
      std::min<uint64_t>(std::max<uint64_t>(prefix_pages, begin) - begin, msg.src_pages.size());
  const uint64_t first = begin + skip;  // the first prompt page read
  const uint64_t count = msg.src_pages.size() - skip;
  *dst_begin = first >= prefix_pages ? first - prefix_pages : 0;
  *dst_end = *dst_begin + count;
  if (count > 0) {
    std::span<const int32_t> src(msg.src_pages.data() + skip, count);
    std::span<const int32_t> dst(info.dst_kv_pages.data() + *dst_begin, count);
    if (Status s = planner::PlanKvWrites(
            plan, {src, dst, msg.last, -1, msg.layer_begin, msg.layer_end}, out);
        !s.ok()) {
      return s;
    }
  }
  if (!*final) return Status::OK();
  planner::TailInput tail;
  if (msg.aux_index && info.aux_index) {
    tail.src_aux = *msg.aux_index;
    tail.dst_aux = *info.aux_index;
  }
  if (!msg.state_indices.empty()) {
    tail.src_state = msg.state_indices;
    tail.src_state_counts = msg.state_counts;
    tail.dst_state = info.dst_state_indices;
    tail.dst_state_counts = info.dst_state_counts;
  }
  tail.request_pages = static_cast<int64_t>(total);
  if (tail_out) *tail_out = tail;
  return planner::PlanTailWrites(plan, tail, out);
}

}  // namespace v1
}  // namespace pdlib
