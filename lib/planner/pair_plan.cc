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

// State maps: prefill buffer k of family f is the family's model-wide buffer start + k on both
// sides. Buffer numbers in the maps are positions in SideLayout::state (every family's).
Status PlanFamilyState(const SideLayout& p, const SideLayout& d, const StateFamilySpan& fp,
                       const StateFamilySpan& fd, int32_t family, bool primary, PairPlan* plan) {
  const auto nd = static_cast<int64_t>(fd.count);
  for (uint32_t k = 0; k < fp.count; ++k) {
    const int64_t global = int64_t{fp.start} + k;
    const int64_t j = global - fd.start;
    if (j < 0 || j >= nd) {
      return Mismatch(
          "prefill %s state buffer %d (model-wide %d, pp %d) has no decode counterpart: "
          "decode pp %d holds %s state buffers [%d, %d)",
          StateTypeName(fp.type), k, global, p.pp_rank, d.pp_rank, StateTypeName(fd.type), fd.start,
          fd.start + nd);
    }
    const StateBufferDesc& sp = p.state[fp.first + k];
    const StateBufferDesc& sd = d.state[fd.first + static_cast<size_t>(j)];
    const auto src = fp.first + k;
    const auto dst = fd.first + static_cast<uint32_t>(j);
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
        plan->state.back().family = family;
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
    plan->state.back().family = family;
  }
  return Status::OK();
}

Capacity FamilyCapacity(const SideLayout& l, const StateFamilySpan& f) {
  Capacity cap = CapacityOf(
      std::vector<StateBufferDesc>(l.state.begin() + f.first, l.state.begin() + f.first + f.count));
  cap.limiting_buffer += f.first;
  return cap;
}

// "mamba, swa" for messages.
std::string FamilyNames(const std::vector<StateFamilySpan>& families) {
  std::string out;
  for (const StateFamilySpan& f : families) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", std::string(StateTypeName(f.type)));
  }
  return out.empty() ? "none" : out;
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
  if (!l.state_families.empty() && (l.state_type != StateType::kNone || l.state_start != 0)) {
    return Invalid(side, "state families given twice (state_families and the shorthand)");
  }
  uint64_t next = 0;
  for (const StateFamilySpan& f : l.Families()) {
    if (f.type == StateType::kNone || static_cast<int32_t>(f.type) < 0 ||
        f.type > StateType::kC128State) {
      if (f.type == StateType::kNone && f.count == 0) {
        return Invalid(side, "a state family of type none");
      }
      return Invalid(side, "%d state buffers of state type %s", f.count, StateTypeName(f.type));
    }
    if (f.first != next) {
      return Invalid(side, "%s state family starts at buffer %d, expected %d",
                     StateTypeName(f.type), f.first, next);
    }
    next += f.count;
    if (f.start < 0 || int64_t{f.start} + f.count > std::numeric_limits<int32_t>::max()) {
      return Invalid(side, "%s state buffers start at model-wide index %d", StateTypeName(f.type),
                     f.start);
    }
  }
  if (next != l.state.size()) {
    return Invalid(side, "state families cover %d of %d state buffers", next, l.state.size());
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
  auto families = EffectiveStateFamilies(args);
  if (!families.ok()) return families.status();
  for (auto [family, name] : {std::pair{&args.kv, "kv"}, std::pair{&args.aux, "aux"}}) {
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
  for (size_t f = 0; f < families->size(); ++f) {
    const StateFamily& fam = (*families)[f];
    const size_t n = fam.buffers.lens.size();
    const std::string name = absl::StrFormat("state family %d (%s)", f, StateTypeName(fam.type));
    if (fam.buffers.item_lens.size() != n ||
        (!fam.buffers.ptrs.empty() && fam.buffers.ptrs.size() != n)) {
      return Status::InvalidArgument(
          absl::StrFormat("%s: %d lens but %d item_lens", name, n, fam.buffers.item_lens.size()));
    }
    for (auto [count, what] : {std::pair{fam.dim_per_tensor.size(), "dim_per_tensor"},
                               std::pair{fam.item_rows.size(), "item_rows"},
                               std::pair{fam.split_units.size(), "split_units"}}) {
      if (count != 0 && count != n) {
        return Status::InvalidArgument(
            absl::StrFormat("%s: %s has %d entries for %d buffers", name, what, count, n));
      }
    }
    l.state_families.push_back(
        {fam.type, fam.start, static_cast<uint32_t>(l.state.size()), static_cast<uint32_t>(n)});
    for (size_t i = 0; i < n; ++i) {
      StateBufferDesc s;
      s.item_bytes = fam.buffers.item_lens[i];
      s.buffer_bytes = fam.buffers.lens[i];
      s.split_dim = fam.dim_per_tensor.empty() ? -1 : fam.dim_per_tensor[i];
      if (!fam.item_rows.empty()) s.rows = fam.item_rows[i];
      if (!fam.split_units.empty()) s.split_units = fam.split_units[i];
      l.state.push_back(s);
    }
  }
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
  const std::vector<StateFamilySpan> pf = p.Families(), df = d.Families();
  bool same_kinds = pf.size() == df.size();
  for (size_t f = 0; same_kinds && f < pf.size(); ++f) same_kinds = pf[f].type == df[f].type;
  if (!same_kinds) {
    return Mismatch("state type mismatch: prefill %s, decode %s", FamilyNames(pf), FamilyNames(df));
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
    if (p.start_layer != d.start_layer || p.num_layers() != d.num_layers()) {
      return Mismatch("pp stage %d differs: prefill layers [%d, %d), decode layers [%d, %d)",
                      p.pp_rank, p.start_layer, p.start_layer + p.num_layers(), d.start_layer,
                      d.start_layer + d.num_layers());
    }
    for (size_t f = 0; f < pf.size(); ++f) {
      if (pf[f].start != df[f].start || pf[f].count != df[f].count) {
        return Mismatch("pp stage %d differs: prefill %s state buffers [%d, %d), decode [%d, %d)",
                        p.pp_rank, StateTypeName(pf[f].type), pf[f].start,
                        int64_t{pf[f].start} + pf[f].count, df[f].start,
                        int64_t{df[f].start} + df[f].count);
      }
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
  plan.topology = *topology;
  plan.active = internal::TpPairTalks(*topology, p.tp_rank, d.tp_rank);
  const bool primary = plan.active && internal::PrimarySenderTp(*topology, d.tp_rank) == p.tp_rank;
  const int32_t aux_stage = d.pp_size == 1 ? p.pp_size - 1 : d.pp_rank;
  plan.writes_aux = primary && p.pp_rank == aux_stage && !p.aux.empty();
  plan.src_kv = CapacityOf(p.kv);
  plan.dst_kv = CapacityOf(d.kv);
  plan.src_aux = CapacityOf(p.aux);
  plan.dst_aux = CapacityOf(d.aux);
  for (size_t f = 0; f < pf.size(); ++f) {
    plan.state_families.push_back({pf[f].type, FamilyCapacity(p, pf[f]), FamilyCapacity(d, df[f])});
  }
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
  for (size_t f = 0; f < pf.size(); ++f) {
    if (Status s = PlanFamilyState(p, d, pf[f], df[f], static_cast<int32_t>(f), primary, &plan);
        !s.ok()) {
      return s;
    }
  }
  return plan;
}

StageExtent ExtentOf(const SideLayout& prefill) {
  StageExtent e{prefill.pp_rank, prefill.start_layer, prefill.num_layers(), {}};
  for (const StateFamilySpan& f : prefill.Families()) {
    e.states.push_back({f.start, static_cast<int32_t>(f.count)});
  }
  return e;
}

namespace {

// Every index in [start, start + count) comes from exactly one of `ranges` (sorted here).
Status CheckCovered(std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t start, int64_t count,
                    int32_t decode_pp, const std::string& what) {
  std::sort(ranges.begin(), ranges.end());
  int64_t next = start;
  for (auto [lo, hi] : ranges) {
    if (lo != next) {
      return Status::FailedPrecondition(
          absl::StrFormat("decode pp %d %s [%d, %d): %s from the prefill stages", decode_pp, what,
                          start, start + count,
                          lo > next ? absl::StrFormat("[%d, %d) come from no stage", next, lo)
                                    : absl::StrFormat("%d comes from two stages", lo)));
    }
    next = hi;
  }
  if (next != start + count) {
    return Status::FailedPrecondition(
        absl::StrFormat("decode pp %d %s [%d, %d): the prefill stages cover up to %d", decode_pp,
                        what, start, start + count, next));
  }
  return Status::OK();
}

}  // namespace

Status CheckStageCoverage(const SideLayout& decode, std::span<const StageExtent> stages) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const StageExtent& e : stages) {
    if (e.num_layers < 0) {
      return Status::InvalidArgument(
          absl::StrFormat("prefill pp %d holds %d layers", e.pp_rank, e.num_layers));
    }
    if (e.num_layers > 0) ranges.emplace_back(e.start_layer, int64_t{e.start_layer} + e.num_layers);
  }
  if (Status s =
          CheckCovered(ranges, decode.start_layer, decode.num_layers(), decode.pp_rank, "layers");
      !s.ok()) {
    return s;
  }
  const std::vector<StateFamilySpan> families = decode.Families();
  for (size_t f = 0; f < families.size(); ++f) {
    ranges.clear();
    for (const StageExtent& e : stages) {
      if (e.states.size() != families.size()) {
        return Status::FailedPrecondition(
            absl::StrFormat("prefill pp %d has %d state families, decode pp %d has %d", e.pp_rank,
                            e.states.size(), decode.pp_rank, families.size()));
      }
      const StageExtent::States& st = e.states[f];
      if (st.count < 0) {
        return Status::InvalidArgument(absl::StrFormat("prefill pp %d holds %d %s state buffers",
                                                       e.pp_rank, st.count,
                                                       StateTypeName(families[f].type)));
      }
      if (st.count > 0) ranges.emplace_back(st.start, int64_t{st.start} + st.count);
    }
    if (Status s =
            CheckCovered(ranges, families[f].start, families[f].count, decode.pp_rank,
                         absl::StrFormat("%s state buffers", StateTypeName(families[f].type)));
        !s.ok()) {
      return s;
    }
  }
  return Status::OK();
}

}  // namespace planner
}  // namespace v1
}  // namespace pdlib
