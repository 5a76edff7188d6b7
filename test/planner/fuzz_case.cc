#include "test/planner/fuzz_case.h"

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <sstream>
#include <vector>

#include "lib/planner/planner.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

// Reads the input a byte at a time; zeros once it runs out.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool Bit() { return Byte() & 1; }
  // In [lo, hi].
  int64_t Range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    uint64_t v = Byte();
    if (span > 256) v = (v << 8) | Byte();
    return lo + static_cast<int64_t>(v % span);
  }
  template <typename T>
  T Pick(std::initializer_list<T> values) {
    return *(values.begin() + Range(0, static_cast<int64_t>(values.size()) - 1));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// In wild mode each decision is corrupted with probability 1/12, so that most wild inputs are
// valid but for one or two fields.
bool Sane(Reader& r, bool wild) { return !wild || r.Range(0, 11) != 0; }

ModelConfig StructuredConfig(Reader& r, bool wild) {
  ModelConfig c;
  if (Sane(r, wild)) {
    c.prefill_tp = r.Pick({1, 2, 4, 8});
    c.decode_tp = r.Pick({1, 2, 4, 8});
    c.prefill_pp = static_cast<int32_t>(r.Range(1, 3));
    c.decode_pp = r.Bit() ? 1 : c.prefill_pp;
    c.kv_heads = r.Pick({1, 2, 4, 8});
  } else {
    c.prefill_tp = static_cast<int32_t>(r.Range(1, 9));
    c.decode_tp = static_cast<int32_t>(r.Range(1, 9));
    c.prefill_pp = static_cast<int32_t>(r.Range(1, 3));
    c.decode_pp = static_cast<int32_t>(r.Range(1, 3));
    c.kv_heads = static_cast<int32_t>(r.Range(1, 12));
  }
  c.head_bytes = static_cast<uint32_t>(r.Range(1, 4));
  c.mla_bytes = static_cast<uint32_t>(r.Range(1, 5));
  c.page_size = r.Pick<uint32_t>({1, 2, 3, 4, 8, 16});
  c.layout = r.Bit() ? KVLayout::kHND : KVLayout::kNHD;
  c.mla = r.Range(0, 3) == 0;
  c.stage_layers.clear();
  for (int32_t s = 0; s < c.prefill_pp; ++s) {
    c.stage_layers.push_back(static_cast<int32_t>(r.Range(0, 2)));
  }
  c.aux_item_bytes.clear();
  for (int64_t a = r.Range(0, 2); a > 0; --a) {
    c.aux_item_bytes.push_back(static_cast<uint32_t>(r.Range(1, 9)));
  }
  c.state_type = static_cast<StateType>(r.Range(0, 6));
  c.state.clear();
  const int64_t tensors = c.state_type == StateType::kNone ? 0 : r.Range(1, 3);
  for (int64_t k = 0; k < tensors; ++k) {
    StateTensorSpec s;
    switch (r.Range(0, 2)) {
      case 0:  // replicated
        s = {-1, 1, 0, static_cast<uint64_t>(r.Range(1, 8))};
        break;
      case 1:  // split by bytes: the full row must split over both TP sizes
        s = {0, 1, 0,
             Sane(r, wild) ? 8 * static_cast<uint64_t>(r.Range(1, 3))
                           : static_cast<uint64_t>(r.Range(1, 24))};
        break;
      default: {  // split by units, along dim 0 or behind rows
        const int32_t dim = static_cast<int32_t>(r.Range(0, 1));
        const uint64_t rows = dim == 0 && Sane(r, wild) ? 1 : static_cast<uint64_t>(r.Range(1, 3));
        const uint64_t units = Sane(r, wild) ? r.Pick<uint64_t>({1, 2, 4, 8, 16})
                                             : static_cast<uint64_t>(r.Range(1, 12));
        s = {dim, rows, units, static_cast<uint64_t>(r.Range(1, 4))};
      }
    }
    c.state.push_back(s);
  }
  c.stage_states.clear();
  int64_t left = tensors;
  for (int32_t s = 0; s < c.prefill_pp; ++s) {
    const int64_t n = s + 1 == c.prefill_pp ? left : r.Range(0, left);
    c.stage_states.push_back(static_cast<int32_t>(Sane(r, wild) ? n : r.Range(0, 2)));
    left -= n;
  }
  c.kv_pool_pages = static_cast<int32_t>(r.Range(1, 6));
  c.state_pool = static_cast<int32_t>(r.Range(1, 6));
  if (Sane(r, wild)) c.state_pool = std::max(c.state_pool, c.kv_pool_pages);
  c.aux_slots = static_cast<int32_t>(r.Range(1, 3));
  return c;
}

std::vector<int32_t> Indices(Reader& r, int32_t pool, int32_t count, bool wild) {
  std::vector<int32_t> out;
  if (count <= pool && Sane(r, wild)) {
    std::vector<int32_t> all(static_cast<size_t>(pool));
    std::iota(all.begin(), all.end(), 0);
    for (int32_t i = 0; i < count; ++i) {  // a partial Fisher-Yates shuffle
      std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(r.Range(i, pool - 1))]);
    }
    out.assign(all.begin(), all.begin() + count);
    if (r.Bit()) std::sort(out.begin(), out.end());
    return out;
  }
  for (int32_t i = 0; i < count; ++i) out.push_back(static_cast<int32_t>(r.Range(-1, pool)));
  return out;
}

Request StructuredRequest(Reader& r, const ModelConfig& c, bool wild) {
  Request q;
  const int64_t ps = c.page_size;
  const int32_t pages =
      static_cast<int32_t>(r.Range(1, Sane(r, wild) ? c.kv_pool_pages : c.kv_pool_pages + 1));
  q.num_tokens = (pages - 1) * ps + r.Range(1, ps);
  int64_t start = 0;
  for (int64_t cuts = r.Range(0, 3); cuts > 0 && start < q.num_tokens; --cuts) {
    const int64_t end =
        Sane(r, wild) ? std::min<int64_t>(start / ps * ps + ps * r.Range(0, 2), (pages - 1) * ps)
                      : r.Range(start, q.num_tokens);
    if (end < start) break;
    q.chunk_tokens.push_back(end - start);
    start = end;
  }
  q.chunk_tokens.push_back(q.num_tokens - start);
  int32_t states = 0;
  switch (c.state_type) {
    case StateType::kNone: states = 0; break;
    case StateType::kMamba: states = static_cast<int32_t>(r.Range(0, 1)); break;
    case StateType::kSwa: states = static_cast<int32_t>(r.Range(0, pages)); break;
    case StateType::kNsa:
    case StateType::kMinimaxIndexK: states = r.Bit() ? pages : 0; break;
    case StateType::kSwaRing:
      states = static_cast<int32_t>(r.Range(0, std::min<int64_t>(3, c.state_pool)));
      break;
    case StateType::kC128State: states = static_cast<int32_t>(r.Range(0, 1)); break;
  }
  if (!Sane(r, wild)) states = static_cast<int32_t>(r.Range(0, 3));
  for (auto [ranks, src] : {std::pair{c.prefill_tp * c.prefill_pp, true},
                            std::pair{c.decode_tp * c.decode_pp, false}}) {
    // A request has a metadata slot on every rank of a side or on none (engines allocate one
    // per request); mixing the two would leave the expected aux bytes undefined. Wild inputs
    // still try an index one past the end, which the planner must refuse.
    const bool side_has_aux = !c.aux_item_bytes.empty() && (Sane(r, wild) || r.Bit());
    for (int32_t i = 0; i < ranks; ++i) {
      (src ? q.src_pages : q.dst_pages).push_back(Indices(r, c.kv_pool_pages, pages, wild));
      int64_t aux = side_has_aux ? r.Range(0, c.aux_slots - 1) : -1;
      if (side_has_aux && !Sane(r, wild)) aux = r.Range(0, c.aux_slots);
      (src ? q.src_aux : q.dst_aux).push_back(aux);
      const int32_t n = Sane(r, wild) ? states : static_cast<int32_t>(r.Range(0, 2));
      (src ? q.src_state : q.dst_state).push_back(Indices(r, c.state_pool, n, wild));
    }
  }
  return q;
}

std::string RunStructured(Reader& r, bool valid) {
  const ModelConfig c = StructuredConfig(r, !valid);
  const Request q = StructuredRequest(r, c, !valid);
  const RunResult res = RunModel(c, q);
  std::string why = res.failure;
  if (why.empty() && valid && !res.accepted) {
    why = "a valid input was refused: " + res.first_error.ToString();
  }
  if (why.empty()) return why;
  return why + "\n  config: " + c.Describe() + "\n  request: " + q.Describe();
}

uint64_t Size(Reader& r) {
  switch (r.Range(0, 7)) {
    case 0: return 0;
    case 1: return std::numeric_limits<uint64_t>::max() - static_cast<uint64_t>(r.Range(0, 3));
    case 2: return uint64_t{1} << r.Range(0, 63);
    default: return static_cast<uint64_t>(r.Range(0, 300));
  }
}

// Up to four arbitrary changes to one field of a valid layout: sizes that overflow, ranks out of
// range, mismatched heads, buffers added or dropped.
void Mutate(Reader& r, SideLayout* l) {
  for (int64_t n = r.Range(0, 4); n > 0; --n) {
    switch (r.Range(0, 15)) {
      case 0: l->tp_size = static_cast<int32_t>(r.Range(0, 9)); break;
      case 1: l->tp_rank = static_cast<int32_t>(r.Range(-1, 9)); break;
      case 2: l->pp_size = static_cast<int32_t>(r.Range(0, 3)); break;
      case 3: l->pp_rank = static_cast<int32_t>(r.Range(-1, 3)); break;
      case 4: l->total_layers = static_cast<int32_t>(r.Range(-1, 6)); break;
      case 5: l->start_layer = static_cast<int32_t>(r.Range(-1, 4)); break;
      case 6: l->total_kv_heads = static_cast<int32_t>(r.Range(0, 12)); break;
      case 7: l->kv_heads = static_cast<int32_t>(r.Range(0, 12)); break;
      case 8:
        l->page_size = static_cast<uint32_t>(r.Bit() ? r.Range(0, 5) : r.Range(0, 70000));
        break;
      case 9: l->layout = l->layout == KVLayout::kNHD ? KVLayout::kHND : KVLayout::kNHD; break;
      case 10: l->is_mla = !l->is_mla; break;
      case 11:
        if (!l->kv.empty()) {
          BufferDesc& b = l->kv[static_cast<size_t>(r.Range(0, 255)) % l->kv.size()];
          (r.Bit() ? b.item_bytes : b.buffer_bytes) = Size(r);
        }
        break;
      case 12:
        if (r.Bit() || l->kv.empty()) {
          l->kv.push_back({Size(r), Size(r)});
        } else {
          l->kv.pop_back();
        }
        break;
      case 13:
        if (!l->aux.empty()) {
          BufferDesc& b = l->aux[static_cast<size_t>(r.Range(0, 255)) % l->aux.size()];
          (r.Bit() ? b.item_bytes : b.buffer_bytes) = Size(r);
        } else {
          l->aux.push_back({Size(r), Size(r)});
        }
        break;
      case 14:
        if (!l->state.empty()) {
          StateBufferDesc& s = l->state[static_cast<size_t>(r.Range(0, 255)) % l->state.size()];
          switch (r.Range(0, 4)) {
            case 0: s.item_bytes = Size(r); break;
            case 1: s.buffer_bytes = Size(r); break;
            case 2: s.split_dim = static_cast<int32_t>(r.Range(-2, 2)); break;
            case 3: s.rows = static_cast<uint64_t>(r.Range(0, 4)); break;
            default: s.split_units = Size(r); break;
          }
        }
        break;
      default:
        l->state_type = static_cast<StateType>(r.Range(0, 7));
        l->state_start = static_cast<int32_t>(r.Range(-1, 3));
        break;
    }
  }
}

std::vector<int32_t> RawIndices(Reader& r) {
  std::vector<int32_t> out;
  for (int64_t n = r.Range(0, 5); n > 0; --n) {
    out.push_back(r.Range(0, 7) == 0 ? std::numeric_limits<int32_t>::max() - 1
                                     : static_cast<int32_t>(r.Range(-1, 12)));
  }
  return out;
}

bool InRegion(uint64_t buffers, const SideLayout& l, RegionKind kind, uint32_t buffer,
              uint64_t offset, uint64_t length) {
  if (buffer >= buffers) return false;
  uint64_t bytes = 0;
  switch (kind) {
    case RegionKind::kKv: bytes = l.kv[buffer].buffer_bytes; break;
    case RegionKind::kAux: bytes = l.aux[buffer].buffer_bytes; break;
    case RegionKind::kState: bytes = l.state[buffer].buffer_bytes; break;
  }
  return length > 0 && offset <= bytes && length <= bytes - offset;
}

size_t FamilySize(const SideLayout& l, RegionKind kind) {
  switch (kind) {
    case RegionKind::kKv: return l.kv.size();
    case RegionKind::kAux: return l.aux.size();
    case RegionKind::kState: return l.state.size();
  }
  return 0;
}

std::string CheckTopology(Reader& r) {
  Topology t;
  t.prefill_tp_size = static_cast<int32_t>(r.Range(0, 16));
  t.decode_tp_size = static_cast<int32_t>(r.Range(0, 16));
  t.prefill_pp_size = static_cast<int32_t>(r.Range(0, 3));
  t.decode_pp_size = static_cast<int32_t>(r.Range(0, 3));
  for (int64_t n = r.Range(0, 3); n > 0; --n) t.split_units.push_back(Size(r) % 40);
  if (!ValidateTopology(t).ok()) return "";
  std::vector<std::vector<RankId>> expected(
      static_cast<size_t>(t.decode_tp_size * t.decode_pp_size));
  for (int32_t pp = 0; pp < t.decode_pp_size; ++pp) {
    for (int32_t d = 0; d < t.decode_tp_size; ++d) {
      auto e = ExpectedPrefillRanks(t, {d, pp});
      if (!e.ok() || e->empty()) return "a decode rank expects nobody";
      expected[static_cast<size_t>(d + pp * t.decode_tp_size)] = *e;
      auto aux = AuxWriter(t, {d, pp});
      if (!aux.ok() || std::count(e->begin(), e->end(), *aux) != 1) {
        return "the aux writer is not an expected sender";
      }
    }
  }
  for (int32_t pp = 0; pp < t.prefill_pp_size; ++pp) {
    for (int32_t p = 0; p < t.prefill_tp_size; ++p) {
      auto targets = TargetsForPrefillRank(t, {p, pp});
      if (!targets.ok()) return "TargetsForPrefillRank failed on a valid topology";
      for (const RankId& d : *targets) {
        const auto& e = expected[static_cast<size_t>(d.tp_rank + d.pp_rank * t.decode_tp_size)];
        if (std::count(e.begin(), e.end(), RankId{p, pp}) != 1) {
          return "targets and expected ranks disagree";
        }
      }
      size_t listed = 0;
      for (const auto& e : expected) listed += std::count(e.begin(), e.end(), RankId{p, pp});
      if (listed != targets->size()) return "expected ranks list a prefill rank more often";
      if (targets->empty()) {
        auto owner = DummyOwner(t, {p, pp});
        if (!owner.ok()) return "a dummy has no owner";
        auto dummies = DummyPrefillRanks(t, *owner);
        if (!dummies.ok() || std::count(dummies->begin(), dummies->end(), RankId{p, pp}) != 1) {
          return "a dummy's owner does not list it";
        }
      }
    }
  }
  return "";
}

std::string RunRaw(Reader& r) {
  if (std::string why = CheckTopology(r); !why.empty()) return why;
  const ModelConfig c = StructuredConfig(r, false);
  SideLayout p = MakeLayout(c, true, static_cast<int32_t>(r.Range(0, c.prefill_tp - 1)),
                            static_cast<int32_t>(r.Range(0, c.prefill_pp - 1)));
  SideLayout d = MakeLayout(c, false, static_cast<int32_t>(r.Range(0, c.decode_tp - 1)),
                            c.decode_pp == 1 ? 0 : p.pp_rank);
  Mutate(r, &p);
  Mutate(r, &d);
  auto plan = MakePairPlan(p, d);
  if (!plan.ok()) return "";
  PlanOutput out;
  for (int64_t chunks = r.Range(1, 3); chunks > 0; --chunks) {
    const std::vector<int32_t> src = RawIndices(r), dst = RawIndices(r);
    const std::vector<int32_t> src_state = RawIndices(r), dst_state = RawIndices(r);
    ChunkInput in;
    in.pages = {src, dst, r.Bit(), r.Range(-1, 40)};
    in.tail = TailInput{};
    in.tail.src_aux = r.Range(-1, 4);
    in.tail.dst_aux = r.Range(-1, 4);
    in.tail.src_state = src_state;
    in.tail.dst_state = dst_state;
    in.tail.request_pages = r.Range(-1, 6);
    if (!PlanChunkWrites(*plan, in, &out).ok()) continue;
    for (const PlannedWrite& w : out.writes) {
      if (!InRegion(FamilySize(p, w.kind), p, w.kind, w.local_buffer, w.local_offset, w.length) ||
          !InRegion(FamilySize(d, w.kind), d, w.kind, w.remote_buffer, w.remote_offset, w.length)) {
        std::ostringstream os;
        os << "a " << RegionKindName(w.kind) << " write leaves its region: prefill buffer "
           << w.local_buffer << " +" << w.local_offset << ", decode buffer " << w.remote_buffer
           << " +" << w.remote_offset << ", length " << w.length << "\n  config: " << c.Describe();
        return os.str();
      }
    }
  }
  return "";
}

}  // namespace

std::string RunFuzzCase(const uint8_t* data, size_t size) {
  Reader r(data, size);
  const uint8_t mode = r.Byte();
  if ((mode & 3) < 2) return RunStructured(r, (mode & 4) != 0);
  return RunRaw(r);
}

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
