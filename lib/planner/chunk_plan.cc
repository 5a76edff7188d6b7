// Per-chunk planning (SPEC R5.2, R5.3, R5.8): validates a chunk's indices against both sides'
// buffers, coalesces (src, dst) runs and turns every buffer map of a PairPlan into writes.
// Allocation-free once the caller's PlanOutput vectors have grown.
#include <algorithm>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace {

const char* SideName(bool prefill) { return prefill ? "prefill" : "decode"; }

// Every index in [0, capacity) of its side's buffers. A side without buffers of the family
// (a PP stage without state tensors) has nothing to address: its indices are not used.
Status CheckIndices(std::span<const int32_t> indices, const Capacity& cap, const char* what,
                    const char* family, bool prefill, RankId rank) {
  if (!cap.any) return Status::OK();
  for (size_t i = 0; i < indices.size(); ++i) {
    const int64_t v = indices[i];
    if (v < 0 || static_cast<uint64_t>(v) >= cap.items) {
      return Status::OutOfRange(absl::StrFormat(
          "%s %s index %d (position %d) out of range [0, %d) of %s buffer %d on %s tp %d pp %d",
          SideName(prefill), what, v, i, cap.items, family, cap.limiting_buffer, SideName(prefill),
          rank.tp_rank, rank.pp_rank));
    }
  }
  return Status::OK();
}

// Merges (src[i], dst[i]) into runs where both sides advance by one.
void Coalesce(std::span<const int32_t> src, std::span<const int32_t> dst,
              std::vector<IndexRun>* runs) {
  runs->clear();
  for (size_t i = 0; i < src.size(); ++i) {
    if (!runs->empty()) {
      IndexRun& last = runs->back();
      if (int64_t{last.src_start} + last.count == src[i] &&
          int64_t{last.dst_start} + last.count == dst[i]) {
        ++last.count;
        continue;
      }
    }
    runs->push_back({src[i], dst[i], 1});
  }
}

// Two runs that write the same decode index would overwrite each other: reject.
Status CheckDistinctRuns(const std::vector<IndexRun>& runs, std::vector<IndexRun>* sorted,
                         const char* what, RankId decode) {
  sorted->assign(runs.begin(), runs.end());
  std::sort(sorted->begin(), sorted->end(),
            [](const IndexRun& a, const IndexRun& b) { return a.dst_start < b.dst_start; });
  for (size_t i = 1; i < sorted->size(); ++i) {
    const IndexRun& a = (*sorted)[i - 1];
    const IndexRun& b = (*sorted)[i];
    if (int64_t{a.dst_start} + a.count > b.dst_start) {
      return Status::InvalidArgument(
          absl::StrFormat("decode %s index %d appears more than once (decode tp %d pp %d)", what,
                          b.dst_start, decode.tp_rank, decode.pp_rank));
    }
  }
  return Status::OK();
}

uint64_t CountWrites(const BufferMap& m, size_t runs, uint64_t items) {
  return m.slice.whole_item ? runs : items * m.slice.pieces;
}

// Appends the writes of map `m` for every run. Indices are validated against the capacity of
// every buffer, so a write that leaves its buffer is a planner bug: checked once per run.
Status EmitRuns(const BufferMap& m, RegionKind kind, const std::vector<IndexRun>& runs,
                PlanOutput* out) {
  const SliceGeometry& g = m.slice;
  for (const IndexRun& r : runs) {
    const uint64_t n = static_cast<uint64_t>(r.count);
    const uint64_t src0 = static_cast<uint64_t>(r.src_start) * m.src_item_bytes;
    const uint64_t dst0 = static_cast<uint64_t>(r.dst_start) * m.dst_item_bytes;
    const uint64_t src_end = g.whole_item ? src0 + n * m.src_item_bytes
                                          : src0 + (n - 1) * m.src_item_bytes + g.src_offset +
                                                (g.pieces - 1) * g.src_stride + g.piece_bytes;
    const uint64_t dst_end = g.whole_item ? dst0 + n * m.dst_item_bytes
                                          : dst0 + (n - 1) * m.dst_item_bytes + g.dst_offset +
                                                (g.pieces - 1) * g.dst_stride + g.piece_bytes;
    if (src_end > m.src_buffer_bytes || dst_end > m.dst_buffer_bytes) {
      return Status::Internal(absl::StrFormat(
          "planner: %s write would leave its buffer (prefill buffer %d: %d > %d bytes, decode "
          "buffer %d: %d > %d bytes)",
          RegionKindName(kind), m.src_buffer, src_end, m.src_buffer_bytes, m.dst_buffer, dst_end,
          m.dst_buffer_bytes));
    }
    if (g.whole_item) {
      out->writes.push_back({kind, m.src_buffer, src0, m.dst_buffer, dst0, n * m.src_item_bytes});
      out->bytes += n * m.src_item_bytes;
      continue;
    }
    for (uint64_t k = 0; k < n; ++k) {
      uint64_t src = src0 + k * m.src_item_bytes + g.src_offset;
      uint64_t dst = dst0 + k * m.dst_item_bytes + g.dst_offset;
      for (uint64_t piece = 0; piece < g.pieces; ++piece) {
        out->writes.push_back({kind, m.src_buffer, src, m.dst_buffer, dst, g.piece_bytes});
        src += g.src_stride;
        dst += g.dst_stride;
      }
    }
    out->bytes += n * g.pieces * g.piece_bytes;
  }
  return Status::OK();
}

// Emits the maps whose layer lies in [layer_begin, layer_end) (aux and state: layer 0, every
// map).
Status EmitAll(const std::vector<BufferMap>& maps, RegionKind kind, uint64_t items, PlanOutput* out,
               int32_t layer_begin = 0, int32_t layer_end = std::numeric_limits<int32_t>::max()) {
  auto in_range = [&](const BufferMap& m) { return m.layer >= layer_begin && m.layer < layer_end; };
  uint64_t count = 0;
  for (const BufferMap& m : maps) {
    if (in_range(m)) count += CountWrites(m, out->runs.size(), items);
  }
  out->writes.reserve(out->writes.size() + count);
  for (const BufferMap& m : maps) {
    if (!in_range(m)) continue;
    if (Status s = EmitRuns(m, kind, out->runs, out); !s.ok()) return s;
  }
  return Status::OK();
}

Status PlanKvImpl(const PairPlan& plan, const ChunkPages& c, PlanOutput* out) {
  const size_t n = c.src_pages.size();
  if (c.dst_pages.size() != n) {
    return Status::InvalidArgument(
        absl::StrFormat("chunk has %d prefill pages but %d decode pages (decode tp %d pp %d)", n,
                        c.dst_pages.size(), plan.decode.tp_rank, plan.decode.pp_rank));
  }
  if (c.num_tokens >= 0) {
    const uint64_t tokens = static_cast<uint64_t>(c.num_tokens);
    if (!c.is_last && tokens % plan.page_size != 0) {
      return Status::InvalidArgument(
          absl::StrFormat("non-last chunk covers %d tokens, not whole %d-token pages (SPEC R5.2)",
                          tokens, plan.page_size));
    }
    const uint64_t pages = (tokens + plan.page_size - 1) / plan.page_size;
    if (pages != n) {
      return Status::InvalidArgument(
          absl::StrFormat("%s chunk covers %d tokens (%d pages of %d) but carries %d pages",
                          c.is_last ? "last" : "non-last", tokens, pages, plan.page_size, n));
    }
  }
  // layer_end -1 (the default): every map.
  const int32_t layer_end = c.layer_end < 0 ? std::numeric_limits<int32_t>::max() : c.layer_end;
  if (c.layer_begin < 0 ||
      (c.layer_end >= 0 && (c.layer_begin > c.layer_end || c.layer_end > plan.prefill_layers))) {
    return Status::OutOfRange(absl::StrFormat(
        "layer range [%d, %d) is not inside the %d KV layers of prefill tp %d pp %d", c.layer_begin,
        c.layer_end, plan.prefill_layers, plan.prefill.tp_rank, plan.prefill.pp_rank));
  }
  if (Status s = CheckIndices(c.src_pages, plan.src_kv, "kv page", "kv", true, plan.prefill);
      !s.ok()) {
    return s;
  }
  if (Status s = CheckIndices(c.dst_pages, plan.dst_kv, "kv page", "kv", false, plan.decode);
      !s.ok()) {
    return s;
  }
  Coalesce(c.src_pages, c.dst_pages, &out->runs);
  if (Status s = CheckDistinctRuns(out->runs, &out->sorted, "kv page", plan.decode); !s.ok()) {
    return s;
  }
  return EmitAll(plan.kv, RegionKind::kKv, n, out, c.layer_begin, layer_end);
}

Status PlanTailImpl(const PairPlan& plan, const TailInput& t, PlanOutput* out) {
  // Aux (R4): one slot row per aux buffer.
  if ((t.src_aux < 0) != (t.dst_aux < 0)) {
    return Status::InvalidArgument(absl::StrFormat(
        "aux slot given on one side only (prefill %d, decode %d)", t.src_aux, t.dst_aux));
  }
  if (t.src_aux >= 0) {
    for (auto [index, cap, prefill, rank] :
         {std::tuple{t.src_aux, &plan.src_aux, true, plan.prefill},
          std::tuple{t.dst_aux, &plan.dst_aux, false, plan.decode}}) {
      if (index > std::numeric_limits<int32_t>::max()) {
        return Status::OutOfRange(
            absl::StrFormat("%s aux index %d exceeds int32", SideName(prefill), index));
      }
      const int32_t i = static_cast<int32_t>(index);
      if (Status s = CheckIndices({&i, 1}, *cap, "aux", "aux", prefill, rank); !s.ok()) return s;
    }
    if (plan.writes_aux) {
      out->runs.assign(1, {static_cast<int32_t>(t.src_aux), static_cast<int32_t>(t.dst_aux), 1});
      if (Status s = EmitAll(plan.aux, RegionKind::kAux, 1, out); !s.ok()) return s;
    }
  }

  // State (R5.8), family by family.
  const size_t families = plan.state_families.size();
  if (families == 0 && !(t.src_state.empty() && t.dst_state.empty())) {
    return Status::InvalidArgument(
        absl::StrFormat("%d state indices given but the model has no state",
                        std::max(t.src_state.size(), t.dst_state.size())));
  }
  for (auto [counts, list, side] : {std::tuple{t.src_state_counts, t.src_state, "prefill"},
                                    std::tuple{t.dst_state_counts, t.dst_state, "decode"}}) {
    if (counts.empty()) {
      if (!list.empty() && families != 1) {
        return Status::InvalidArgument(absl::StrFormat(
            "%d %s state indices without per-family counts, but the model has %d state families",
            list.size(), side, families));
      }
      continue;
    }
    if (counts.size() != families) {
      return Status::InvalidArgument(absl::StrFormat(
          "%s state indices for %d families, but the model has %d", side, counts.size(), families));
    }
    uint64_t sum = 0;
    for (uint32_t c : counts) sum += c;
    if (sum != list.size()) {
      return Status::InvalidArgument(absl::StrFormat(
          "%s state index counts add up to %d, but %d indices were given", side, sum, list.size()));
    }
  }
  size_t src_at = 0, dst_at = 0;
  for (size_t f = 0; f < families; ++f) {
    const PairPlan::Family& fam = plan.state_families[f];
    const size_t ns = t.src_state_counts.empty() ? t.src_state.size() : t.src_state_counts[f];
    const size_t nd = t.dst_state_counts.empty() ? t.dst_state.size() : t.dst_state_counts[f];
    std::span<const int32_t> src = t.src_state.subspan(src_at, ns);
    std::span<const int32_t> dst = t.dst_state.subspan(dst_at, nd);
    src_at += ns;
    dst_at += nd;
    auto pairing = AlignStateLists(fam.type, ns, nd, t.request_pages);
    if (!pairing.ok()) return pairing.status().WithPrefix(absl::StrFormat("state family %d", f));
    src = src.subspan(pairing->src_begin, pairing->count);
    dst = dst.subspan(pairing->dst_begin, pairing->count);
    if (src.empty()) continue;
    const std::string family = absl::StrFormat("%s state", StateTypeName(fam.type));
    if (Status s = CheckIndices(src, fam.src, "state", family.c_str(), true, plan.prefill);
        !s.ok()) {
      return s;
    }
    if (Status s = CheckIndices(dst, fam.dst, "state", family.c_str(), false, plan.decode);
        !s.ok()) {
      return s;
    }
    Coalesce(src, dst, &out->runs);
    if (Status s = CheckDistinctRuns(out->runs, &out->sorted, family.c_str(), plan.decode);
        !s.ok()) {
      return s;
    }
    uint64_t count = 0;
    for (const BufferMap& m : plan.state) {
      if (m.family == static_cast<int32_t>(f))
        count += CountWrites(m, out->runs.size(), src.size());
    }
    out->writes.reserve(out->writes.size() + count);
    for (const BufferMap& m : plan.state) {
      if (m.family != static_cast<int32_t>(f)) continue;
      if (Status s = EmitRuns(m, RegionKind::kState, out->runs, out); !s.ok()) return s;
    }
  }
  return Status::OK();
}

}  // namespace

const char* RegionKindName(RegionKind kind) {
  switch (kind) {
    case RegionKind::kKv: return "kv";
    case RegionKind::kAux: return "aux";
    case RegionKind::kState: return "state";
  }
  return "unknown";
}

StatusOr<StatePairing> AlignStateLists(StateType type, size_t src_len, size_t dst_len,
                                       int64_t request_pages) {
  const char* kind = StateTypeName(type).data();
  auto refuse = [&](const char* why) {
    return Status::InvalidArgument(absl::StrFormat(
        "%s state: %d prefill indices, %d decode indices: %s", kind, src_len, dst_len, why));
  };
  if (type == StateType::kNone) {
    if (src_len != 0 || dst_len != 0) return refuse("the family has no kind");
    return StatePairing{};
  }
  // A side that names no index for the family does not take part this time (SGLang's backends
  // skip a family prefill passes None for): nothing is written.
  if (src_len == 0 || dst_len == 0) return StatePairing{};
  switch (type) {
    case StateType::kNone: return StatePairing{};
    case StateType::kMamba:
    case StateType::kC128State:
      // One request-scoped slot (c128_state: or none, when no partial block is pending); the
      // slot is the request's on both sides, so the lists must match exactly.
      if (src_len > 1 || dst_len > 1) return refuse("takes at most one slot per request");
      return StatePairing{0, 0, src_len};
    case StateType::kSwaRing:
      // Rows of token positions: a shift would pair rows of other positions.
      if (src_len != dst_len) return refuse("ring rows are matched by position and must match");
      return StatePairing{0, 0, src_len};
    case StateType::kSwa:
    case StateType::kNsa:
    case StateType::kMinimaxIndexK: {
      // Paged kinds: the two sides' allocators may round the window or the sequence to pages
      // differently, so the lists may differ by one page; the first pages of the shorter list's
      // length pair up (SGLang's Mooncake backend truncates the longer list the same way). More
      // than one page apart is a request the sides see differently: refused.
      const size_t n = std::min(src_len, dst_len);
      if (std::max(src_len, dst_len) - n > 1) return refuse("paged state may differ by one page");
      if (request_pages >= 0) {
        // The window lies inside the request; a full-sequence list has one index per page of
        // the request (decode's prefix pages included), on one side at least when they differ.
        const auto pages = static_cast<uint64_t>(request_pages);
        if (type == StateType::kSwa && n > pages) {
          return refuse(
              absl::StrFormat("more window pages than the request's %d pages", pages).c_str());
        }
        if (type != StateType::kSwa && n != 0 && src_len != pages && dst_len != pages) {
          return refuse(absl::StrFormat("full-sequence state has one index per page of the "
                                        "request's %d pages",
                                        pages)
                            .c_str());
        }
      }
      return StatePairing{0, 0, n};
    }
  }
  return refuse("unknown kind");
}

Status PlanKvWrites(const PairPlan& plan, const ChunkPages& chunk, PlanOutput* out) {
  Status s = PlanKvImpl(plan, chunk, out);
  if (!s.ok()) {
    out->writes.clear();
    out->bytes = 0;
  }
  return s;
}

Status PlanTailWrites(const PairPlan& plan, const TailInput& tail, PlanOutput* out) {
  Status s = PlanTailImpl(plan, tail, out);
  if (!s.ok()) {
    out->writes.clear();
    out->bytes = 0;
  }
  return s;
}

Status PlanChunkWrites(const PairPlan& plan, const ChunkInput& chunk, PlanOutput* out) {
  out->writes.clear();
  out->bytes = 0;
  if (Status s = PlanKvWrites(plan, chunk.pages, out); !s.ok()) return s;
  if (!chunk.pages.is_last) return Status::OK();
  return PlanTailWrites(plan, chunk.tail, out);
}

Status CheckDistinct(std::span<const int32_t> indices, const char* what, const char* side,
                     std::vector<int32_t>* scratch) {
  scratch->assign(indices.begin(), indices.end());
  std::sort(scratch->begin(), scratch->end());
  auto dup = std::adjacent_find(scratch->begin(), scratch->end());
  if (dup != scratch->end()) {
    return Status::InvalidArgument(
        absl::StrFormat("%s %s index %d appears more than once", side, what, *dup));
  }
  return Status::OK();
}

}  // namespace planner
}  // namespace v1
}  // namespace pdlib
