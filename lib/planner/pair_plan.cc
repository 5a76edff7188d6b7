// Per-connection planning: validates one side, checks that a prefill and a decode rank can
// exchange KV (R6.4 shape checks, R5.6 PP pairing) and computes the buffer maps and slices of
// what the prefill rank writes to the decode rank.
#include <algorithm>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lib/planner/planner.h"
#include "lib/planner/topology_internal.h"

namespace pdlib {
inline namespace v1 {
namespace planner {

using internal::Holding;
using internal::HoldOf;
using internal::kMaxRanks;
using internal::UnitRange;

namespace {

template <typename... Args>
Status Invalid(const char* side, const absl::FormatSpec<Args...>& format, const Args&... args) {
  return Status::InvalidArgument(absl::StrCat(side, ": ", absl::StrFormat(format, args...)));
}

template <typename... Args>
Status Mismatch(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return Status::FailedPrecondition(absl::StrFormat(format, args...));
}

template <typename Desc>
Capacity CapacityOf(const std::vector<Desc>& buffers) {
  Capacity cap;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const uint64_t items = buffers[i].buffer_bytes / buffers[i].item_bytes;
    if (!cap.any || items < cap.items) {
      cap.items = items;
      cap.limiting_buffer = static_cast<uint32_t>(i);
      cap.any = true;
    }
  }
  return cap;
}

template <typename Desc>
Status CheckBuffers(const std::vector<Desc>& buffers, const char* family, const char* side) {
  if (buffers.size() > std::numeric_limits<uint32_t>::max()) {
    return Invalid(side, "%d %s buffers are too many", buffers.size(), family);
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].item_bytes == 0 || buffers[i].item_bytes > buffers[i].buffer_bytes) {
      return Invalid(side, "%s buffer %d: item size %d must be in [1, buffer size %d]", family, i,
                     buffers[i].item_bytes, buffers[i].buffer_bytes);
    }
  }
  return Status::OK();
}

// The slice of units [r.lo, r.hi) of an item laid out [rows][held units][inner bytes] on each
// side (see planner.h). Checks that every piece stays inside the item on both sides.
StatusOr<SliceGeometry> MakeSlice(uint64_t rows, uint64_t inner, const Holding& p, const Holding& d,
                                  UnitRange r, uint64_t src_item, uint64_t dst_item) {
  SliceGeometry g;
  const uint64_t count = r.hi - r.lo;
  if (count == p.count && count == d.count) {
    g.whole_item = true;
    g.pieces = 1;
    g.piece_bytes = src_item;
  } else {
    g.pieces = rows;
    g.piece_bytes = count * inner;
    g.src_offset = (r.lo - p.start) * inner;
    g.dst_offset = (r.lo - d.start) * inner;
    g.src_stride = p.count * inner;
    g.dst_stride = d.count * inner;
  }
  const uint64_t src_end = g.src_offset + (g.pieces - 1) * g.src_stride + g.piece_bytes;
  const uint64_t dst_end = g.dst_offset + (g.pieces - 1) * g.dst_stride + g.piece_bytes;
  if (src_end > src_item || dst_end > dst_item || (g.whole_item && src_item != dst_item)) {
    return Status::Internal(absl::StrFormat(
        "slice of units [%d, %d) leaves its item (prefill %d of %d bytes, decode %d of %d)", r.lo,
        r.hi, src_end, src_item, dst_end, dst_item));
  }
  return g;
}

BufferMap MapOf(uint32_t src, uint32_t dst, uint64_t src_item, uint64_t dst_item,
                uint64_t src_bytes, uint64_t dst_bytes, const SliceGeometry& slice) {
  return {src, dst, src_item, dst_item, src_bytes, dst_bytes, slice};
}

const char* KvName(bool is_mla, int32_t kv) { return is_mla ? "KV" : (kv == 0 ? "K" : "V"); }

// KV maps: every local prefill layer onto the decode buffer of the same global layer.
Status PlanKv(const SideLayout& p, const SideLayout& d, const Topology& t, PairPlan* plan) {
  const uint64_t units = t.split_units.front();
  const Holding hp = HoldOf(units, p.tp_size, p.tp_rank);
  const Holding hd = HoldOf(units, d.tp_size, d.tp_rank);
  const UnitRange sent =
      plan->active ? internal::SentUnits(units, p.tp_size, d.tp_size, p.tp_rank, d.tp_rank)
                   : UnitRange{};
  const int32_t kinds = p.is_mla ? 1 : 2;
  const int32_t np = p.num_layers();
  const int32_t nd = d.num_layers();
  for (int32_t i = 0; i < np; ++i) {
    const int32_t layer = p.start_layer + i;
    const int32_t j = layer - d.start_layer;
    if (j < 0 || j >= nd) {
      return Mismatch(
          "prefill layer %d (pp %d) has no decode counterpart: decode pp %d holds "
          "layers [%d, %d)",
          layer, p.pp_rank, d.pp_rank, d.start_layer, d.start_layer + nd);
    }
    for (int32_t kv = 0; kv < kinds; ++kv) {
      const uint32_t src = static_cast<uint32_t>(kv * np + i);
      const uint32_t dst = static_cast<uint32_t>(kv * nd + j);
      const BufferDesc& bp = p.kv[src];
      const BufferDesc& bd = d.kv[dst];
      uint64_t rows = 1, inner = bp.item_bytes;
      if (p.is_mla) {
        if (bp.item_bytes != bd.item_bytes) {
          return Mismatch("layer %d MLA page size mismatch: prefill %d bytes, decode %d", layer,
                          bp.item_bytes, bd.item_bytes);
        }
      } else {
        const uint64_t head_p = bp.item_bytes / (uint64_t{p.page_size} * p.kv_heads);
        const uint64_t head_d = bd.item_bytes / (uint64_t{d.page_size} * d.kv_heads);
        if (head_p != head_d) {
          return Mismatch(
              "layer %d %s: head size mismatch: prefill %d bytes per token per head (%d-byte "
              "pages, %d heads), decode %d (%d-byte pages, %d heads)",
              layer, KvName(false, kv), head_p, bp.item_bytes, p.kv_heads, head_d, bd.item_bytes,
              d.kv_heads);
        }
        rows = p.layout == KVLayout::kNHD ? p.page_size : 1;
        inner = p.layout == KVLayout::kNHD ? head_p : head_p * p.page_size;
      }
      if (sent.empty()) continue;
      auto slice = MakeSlice(rows, inner, hp, hd, sent, bp.item_bytes, bd.item_bytes);
      if (!slice.ok()) return slice.status();
      plan->kv.push_back(
          MapOf(src, dst, bp.item_bytes, bd.item_bytes, bp.buffer_bytes, bd.buffer_bytes, *slice));
      plan->kv.back().layer = p.LayerOf(i);
    }
  }
  return Status::OK();
}

// State maps: prefill state buffer k is model-wide buffer state_start + k on both sides.
Status PlanState(const SideLayout& p, const SideLayout& d, bool primary, PairPlan* plan) {
  const auto nd = static_cast<int64_t>(d.state.size());
  for (size_t k = 0; k < p.state.size(); ++k) {
    const int64_t global = int64_t{p.state_start} + static_cast<int64_t>(k);
    const int64_t j = global - d.state_start;
    if (j < 0 || j >= nd) {
      return Mismatch(
          "prefill state buffer %d (model-wide %d, pp %d) has no decode counterpart: "
          "decode pp %d holds state buffers [%d, %d)",
          k, global, p.pp_rank, d.pp_rank, d.state_start, d.state_start + nd);
    }
    const StateBufferDesc& sp = p.state[k];
    const StateBufferDesc& sd = d.state[static_cast<size_t>(j)];
    const auto src = static_cast<uint32_t>(k);
    const auto dst = static_cast<uint32_t>(j);
    if (sp.split_dim != sd.split_dim) {
      return Mismatch("state buffer %d: split dimension mismatch: prefill %d, decode %d", global,
                      sp.split_dim, sd.split_dim);
    }
    if (sp.split_dim < 0) {
      if (sp.item_bytes != sd.item_bytes) {
        return Mismatch("state buffer %d (replicated): item size mismatch: prefill %d, decode %d",
                        global, sp.item_bytes, sd.item_bytes);
      }
      if (primary) {
        SliceGeometry whole;
        whole.whole_item = true;
        whole.pieces = 1;
        whole.piece_bytes = sp.item_bytes;
        plan->state.push_back(
            MapOf(src, dst, sp.item_bytes, sd.item_bytes, sp.buffer_bytes, sd.buffer_bytes, whole));
      }
      continue;
    }
    const uint64_t units_p = internal::StateUnits(sp, p.tp_size);
    const uint64_t units_d = internal::StateUnits(sd, d.tp_size);
    if (sp.rows != sd.rows || units_p != units_d) {
      return Mismatch(
          "state buffer %d: split shape mismatch: prefill %d rows x %d units (TP %d, %d-byte "
          "items), decode %d rows x %d units (TP %d, %d-byte items)",
          global, sp.rows, units_p, p.tp_size, sp.item_bytes, sd.rows, units_d, d.tp_size,
          sd.item_bytes);
    }
    const Holding hp = HoldOf(units_p, p.tp_size, p.tp_rank);
    const Holding hd = HoldOf(units_d, d.tp_size, d.tp_rank);
    const uint64_t inner_p = sp.item_bytes / sp.rows / hp.count;
    const uint64_t inner_d = sd.item_bytes / sd.rows / hd.count;
    if (inner_p != inner_d) {
      return Mismatch("state buffer %d: bytes per unit mismatch: prefill %d, decode %d", global,
                      inner_p, inner_d);
    }
    if (!plan->active) continue;
    const UnitRange sent = internal::SentUnits(units_p, p.tp_size, d.tp_size, p.tp_rank, d.tp_rank);
    if (sent.empty()) continue;
    auto slice = MakeSlice(sp.rows, inner_p, hp, hd, sent, sp.item_bytes, sd.item_bytes);
    if (!slice.ok()) return slice.status();
    plan->state.push_back(
        MapOf(src, dst, sp.item_bytes, sd.item_bytes, sp.buffer_bytes, sd.buffer_bytes, *slice));
  }
  return Status::OK();
}

}  // namespace

Status ValidateSideLayout(const SideLayout& l, const char* side) {
  if (l.tp_size < 1 || l.tp_size > kMaxRanks || l.tp_rank < 0 || l.tp_rank >= l.tp_size) {
    return Invalid(side, "TP rank %d of size %d (size must be in [1, %d])", l.tp_rank, l.tp_size,
                   kMaxRanks);
  }
  if (l.pp_size < 1 || l.pp_size > kMaxRanks || l.pp_rank < 0 || l.pp_rank >= l.pp_size) {
    return Invalid(side, "PP rank %d of size %d (size must be in [1, %d])", l.pp_rank, l.pp_size,
                   kMaxRanks);
  }
  if (l.page_size == 0) return Invalid(side, "page size 0");
  if (!l.is_mla) {
    if (l.kv.size() % 2 != 0) {
      return Invalid(side, "%d kv buffers: a non-MLA model registers a K and a V buffer per layer",
                     l.kv.size());
    }
    if (l.total_kv_heads < 1) return Invalid(side, "%d kv heads in the model", l.total_kv_heads);
    if (Status s = internal::CheckUnits(static_cast<uint64_t>(l.total_kv_heads), l.tp_size,
                                        "kv heads", side);
        !s.ok()) {
      return s.WithPrefix(side);
    }
    const uint64_t held = HoldOf(static_cast<uint64_t>(l.total_kv_heads), l.tp_size, 0).count;
    if (static_cast<uint64_t>(l.kv_heads) != held) {
      return Invalid(side, "holds %d kv heads, but %d heads over TP %d give %d per rank",
                     l.kv_heads, l.total_kv_heads, l.tp_size, held);
    }
  }
  if (l.total_layers < 0 || l.start_layer < 0 ||
      int64_t{l.start_layer} + l.num_layers() > l.total_layers) {
    return Invalid(side, "layers [%d, %d) of this stage outside the model's %d layers",
                   l.start_layer, int64_t{l.start_layer} + l.num_layers(), l.total_layers);
  }
  if (Status s = CheckBuffers(l.kv, "kv", side); !s.ok()) return s;
  if (!l.is_mla) {
    const uint64_t token_heads = uint64_t{l.page_size} * static_cast<uint64_t>(l.kv_heads);
    for (size_t i = 0; i < l.kv.size(); ++i) {
      if (l.kv[i].item_bytes % token_heads != 0) {
        return Invalid(side,
                       "kv buffer %d: %d-byte pages do not split into %d tokens x %d heads of "
                       "whole bytes",
                       i, l.kv[i].item_bytes, l.page_size, l.kv_heads);
      }
    }
  }
  if (Status s = CheckBuffers(l.aux, "aux", side); !s.ok()) return s;
  if (Status s = CheckBuffers(l.state, "state", side); !s.ok()) return s;
  if (l.state_type == StateType::kNone && !l.state.empty()) {
    return Invalid(side, "%d state buffers but state type none", l.state.size());
  }
  if (l.state_start < 0 || int64_t{l.state_start} + static_cast<int64_t>(l.state.size()) >
                               std::numeric_limits<int32_t>::max()) {
    return Invalid(side, "state buffers start at model-wide index %d", l.state_start);
  }
  for (size_t i = 0; i < l.state.size(); ++i) {
    const StateBufferDesc& s = l.state[i];
    if (s.split_dim < -1) {
      return Invalid(side, "state buffer %d: split dimension %d (-1: replicated)", i, s.split_dim);
    }
    if (s.split_dim < 0) continue;
    if (s.rows == 0 || s.item_bytes % s.rows != 0 || (s.split_dim == 0 && s.rows != 1)) {
      return Invalid(side,
                     "state buffer %d: %d rows before split dimension %d do not divide its "
                     "%d-byte items (dimension 0 has 1 row)",
                     i, s.rows, s.split_dim, s.item_bytes);
    }
    if (s.split_units == 0 && s.item_bytes / s.rows > internal::kMaxUnits / l.tp_size) {
      return Invalid(side, "state buffer %d: %d-byte rows are too large to split by bytes", i,
                     s.item_bytes / s.rows);
    }
    const uint64_t units = internal::StateUnits(s, l.tp_size);
    const std::string what = absl::StrFormat("state buffer %d split dimension", i);
    if (Status st = internal::CheckUnits(units, l.tp_size, what.c_str(), side); !st.ok()) {
      return st.WithPrefix(side);
    }
    const uint64_t held = HoldOf(units, l.tp_size, l.tp_rank).count;
    if ((s.item_bytes / s.rows) % held != 0) {
      return Invalid(side, "state buffer %d: %d-byte rows do not split into %d units", i,
                     s.item_bytes / s.rows, held);
    }
  }
  return Status::OK();
}

StatusOr<SideLayout> SideLayoutFromKVArgs(const KVArgs& args) {
  SideLayout l;
  l.tp_size = args.parallel.tp_size;
  l.tp_rank = args.parallel.tp_rank;
  l.pp_size = args.parallel.pp_size;
  l.pp_rank = args.parallel.pp_rank;
  l.total_layers = args.fingerprint.num_layers;
  l.start_layer = args.prefill_start_layer;
  l.total_kv_heads = args.fingerprint.num_kv_heads;
  l.kv_heads = args.kv_head_num;
  l.page_size = args.page_size;
  l.layout = args.kv_layout;
  l.is_mla = args.is_mla;
  l.state_type = args.state_type;
  for (auto [family, name] :
       {std::pair{&args.kv, "kv"}, std::pair{&args.aux, "aux"}, std::pair{&args.state, "state"}}) {
    if (family->lens.size() != family->item_lens.size()) {
      return Status::InvalidArgument(absl::StrFormat("%s buffers: %d lens but %d item_lens", name,
                                                     family->lens.size(),
                                                     family->item_lens.size()));
    }
  }
  for (size_t i = 0; i < args.kv.lens.size(); ++i) {
    l.kv.push_back({args.kv.item_lens[i], args.kv.lens[i]});
  }
  // Without a fingerprint a single stage holds the whole model.
  if (l.total_layers == 0 && l.pp_size == 1) l.total_layers = l.num_layers();
  for (size_t i = 0; i < args.aux.lens.size(); ++i) {
    l.aux.push_back({args.aux.item_lens[i], args.aux.lens[i]});
  }
  if (!args.state_dim_per_tensor.empty() &&
      args.state_dim_per_tensor.size() != args.state.lens.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("state_dim_per_tensor has %d entries for %d state buffers",
                        args.state_dim_per_tensor.size(), args.state.lens.size()));
  }
  for (auto [n, name] : {std::pair{args.state_item_rows.size(), "state_item_rows"},
                         std::pair{args.state_split_units.size(), "state_split_units"}}) {
    if (n != 0 && n != args.state.lens.size()) {
      return Status::InvalidArgument(absl::StrFormat("%s has %d entries for %d state buffers", name,
                                                     n, args.state.lens.size()));
    }
  }
  for (size_t i = 0; i < args.state.lens.size(); ++i) {
    StateBufferDesc s;
    s.item_bytes = args.state.item_lens[i];
    s.buffer_bytes = args.state.lens[i];
    s.split_dim = args.state_dim_per_tensor.empty() ? -1 : args.state_dim_per_tensor[i];
    if (!args.state_item_rows.empty()) s.rows = args.state_item_rows[i];
    if (!args.state_split_units.empty()) s.split_units = args.state_split_units[i];
    l.state.push_back(s);
  }
  l.state_start = args.state_start;
  return l;
}

StatusOr<PairPlan> MakePairPlan(const SideLayout& p, const SideLayout& d) {
  if (Status s = ValidateSideLayout(p, "prefill"); !s.ok()) return s;
  if (Status s = ValidateSideLayout(d, "decode"); !s.ok()) return s;
  if (p.page_size != d.page_size) {
    return Mismatch("page size mismatch: prefill %d tokens, decode %d", p.page_size, d.page_size);
  }
  if (p.is_mla != d.is_mla) {
    return Mismatch("MLA mismatch: prefill %s, decode %s", p.is_mla ? "MLA" : "not MLA",
                    d.is_mla ? "MLA" : "not MLA");
  }
  if (!p.is_mla && (p.layout != d.layout || p.total_kv_heads != d.total_kv_heads)) {
    return Mismatch("KV shape mismatch: prefill %s with %d kv heads, decode %s with %d",
                    KVLayoutName(p.layout), p.total_kv_heads, KVLayoutName(d.layout),
                    d.total_kv_heads);
  }
  if (p.total_layers != d.total_layers) {
    return Mismatch("layer count mismatch: prefill model %d layers, decode %d", p.total_layers,
                    d.total_layers);
  }
  if (p.state_type != d.state_type) {
    return Mismatch("state type mismatch: prefill %s, decode %s", StateTypeName(p.state_type),
                    StateTypeName(d.state_type));
  }
  if (p.aux.size() != d.aux.size()) {
    return Mismatch("aux buffer count mismatch: prefill %d, decode %d", p.aux.size(), d.aux.size());
  }
  for (size_t i = 0; i < p.aux.size(); ++i) {
    if (p.aux[i].item_bytes != d.aux[i].item_bytes) {
      return Mismatch("aux buffer %d item size mismatch: prefill %d bytes, decode %d", i,
                      p.aux[i].item_bytes, d.aux[i].item_bytes);
    }
  }
  auto topology = MakeTopology(d, p.tp_size, p.pp_size);
  if (!topology.ok()) return topology.status();
  if (d.pp_size == p.pp_size) {
    if (d.pp_rank != p.pp_rank) {
      return Status::InvalidArgument(absl::StrFormat(
          "prefill pp %d paired with decode pp %d: with equal PP sizes stages pair one to one",
          p.pp_rank, d.pp_rank));
    }
    if (p.start_layer != d.start_layer || p.num_layers() != d.num_layers() ||
        p.state_start != d.state_start || p.state.size() != d.state.size()) {
      return Mismatch(
          "pp stage %d differs: prefill layers [%d, %d) state buffers [%d, %d), decode layers "
          "[%d, %d) state buffers [%d, %d)",
          p.pp_rank, p.start_layer, p.start_layer + p.num_layers(), p.state_start,
          p.state_start + static_cast<int64_t>(p.state.size()), d.start_layer,
          d.start_layer + d.num_layers(), d.state_start,
          d.state_start + static_cast<int64_t>(d.state.size()));
    }
  } else if (d.start_layer != 0 || d.num_layers() != d.total_layers) {
    // Decode PP 1 (MakeTopology rejected anything else): it holds every layer.
    return Mismatch("decode PP 1 must hold all %d layers, it holds [%d, %d)", d.total_layers,
                    d.start_layer, d.start_layer + d.num_layers());
  }

  PairPlan plan;
  plan.prefill = {p.tp_rank, p.pp_rank};
  plan.decode = {d.tp_rank, d.pp_rank};
  plan.page_size = p.page_size;
  plan.prefill_layers = p.engine_layers();
  plan.state_type = p.state_type;
  plan.topology = *topology;
  plan.active = internal::TpPairTalks(*topology, p.tp_rank, d.tp_rank);
  const bool primary = plan.active && internal::PrimarySenderTp(*topology, d.tp_rank) == p.tp_rank;
  const int32_t aux_stage = d.pp_size == 1 ? p.pp_size - 1 : d.pp_rank;
  plan.writes_aux = primary && p.pp_rank == aux_stage && !p.aux.empty();
  plan.src_kv = CapacityOf(p.kv);
  plan.dst_kv = CapacityOf(d.kv);
  plan.src_aux = CapacityOf(p.aux);
  plan.dst_aux = CapacityOf(d.aux);
  plan.src_state = CapacityOf(p.state);
  plan.dst_state = CapacityOf(d.state);
  if (Status s = PlanKv(p, d, *topology, &plan); !s.ok()) return s;
  if (plan.writes_aux) {
    for (size_t i = 0; i < p.aux.size(); ++i) {
      SliceGeometry whole;
      whole.whole_item = true;
      whole.pieces = 1;
      whole.piece_bytes = p.aux[i].item_bytes;
      plan.aux.push_back(MapOf(static_cast<uint32_t>(i), static_cast<uint32_t>(i),
                               p.aux[i].item_bytes, d.aux[i].item_bytes, p.aux[i].buffer_bytes,
                               d.aux[i].buffer_bytes, whole));
    }
  }
  if (Status s = PlanState(p, d, primary, &plan); !s.ok()) return s;
  return plan;
}

StageExtent ExtentOf(const SideLayout& prefill) {
  return {prefill.pp_rank, prefill.start_layer, prefill.num_layers(), prefill.state_start,
          static_cast<int32_t>(prefill.state.size())};
}

Status CheckStageCoverage(const SideLayout& decode, std::span<const StageExtent> stages) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (auto [what, start, count, first_of, count_of] :
       {std::tuple{"layers", int64_t{decode.start_layer}, int64_t{decode.num_layers()},
                   &StageExtent::start_layer, &StageExtent::num_layers},
        std::tuple{"state buffers", int64_t{decode.state_start},
                   static_cast<int64_t>(decode.state.size()), &StageExtent::state_start,
                   &StageExtent::num_states}}) {
    ranges.clear();
    for (const StageExtent& e : stages) {
      if (e.*count_of < 0) {
        return Status::InvalidArgument(
            absl::StrFormat("prefill pp %d holds %d %s", e.pp_rank, e.*count_of, what));
      }
      if (e.*count_of > 0) ranges.emplace_back(e.*first_of, int64_t{e.*first_of} + e.*count_of);
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t next = start;
    for (auto [lo, hi] : ranges) {
      if (lo != next) {
        return Status::FailedPrecondition(
            absl::StrFormat("decode pp %d %s [%d, %d): %s from the prefill stages", decode.pp_rank,
                            what, start, start + count,
                            lo > next ? absl::StrFormat("[%d, %d) come from no stage", next, lo)
                                      : absl::StrFormat("%d comes from two stages", lo)));
      }
      next = hi;
    }
    if (next != start + count) {
      return Status::FailedPrecondition(
          absl::StrFormat("decode pp %d %s [%d, %d): the prefill stages cover up to %d",
                          decode.pp_rank, what, start, start + count, next));
    }
  }
  return Status::OK();
}

}  // namespace planner
}  // namespace v1
}  // namespace pdlib
