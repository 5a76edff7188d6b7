#include "test/planner/reference_model.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

// One byte of "what belongs here": a mix of the tag and the coordinates.
uint8_t Pattern(uint64_t tag, uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
  uint64_t x = tag * 0x9E3779B97F4A7C15ull;
  x = (x ^ a) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ b) * 0x94D049BB133111EBull;
  x = (x ^ c) * 0x9E3779B97F4A7C15ull;
  x = (x ^ d) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ e) * 0x94D049BB133111EBull;
  return static_cast<uint8_t>((x ^ (x >> 31)) >> 56);
}

constexpr uint8_t kJunk = 0xEE;

// Units a rank holds under the engines' convention (see planner.h): the reference's own copy.
struct Held {
  uint64_t start = 0;
  uint64_t count = 0;
};
Held HeldUnits(uint64_t units, int32_t tp, int32_t rank) {
  const uint64_t t = static_cast<uint64_t>(tp);
  const uint64_t r = static_cast<uint64_t>(rank);
  if (units == 0) return {0, 0};
  if (units >= t) return {r * (units / t), units / t};
  return {r / (t / units), 1};
}

struct Stage {
  int32_t start_layer = 0;
  int32_t num_layers = 0;
  int32_t state_start = 0;
  int32_t num_states = 0;
};

Stage StageOf(const ModelConfig& c, bool prefill, int32_t pp_rank) {
  if (!prefill && c.decode_pp == 1) {
    return {0, c.total_layers(), 0, static_cast<int32_t>(c.state.size())};
  }
  Stage s;
  if (pp_rank >= static_cast<int32_t>(c.stage_layers.size())) return s;
  for (int32_t i = 0; i < pp_rank; ++i) {
    s.start_layer += c.stage_layers[i];
    if (i < static_cast<int32_t>(c.stage_states.size())) s.state_start += c.stage_states[i];
  }
  s.num_layers = c.stage_layers[pp_rank];
  if (pp_rank < static_cast<int32_t>(c.stage_states.size())) s.num_states = c.stage_states[pp_rank];
  return s;
}

uint64_t KvHeadsHeld(const ModelConfig& c, int32_t tp) {
  return c.mla ? 1 : HeldUnits(static_cast<uint64_t>(c.kv_heads), tp, 0).count;
}

uint64_t KvItemBytes(const ModelConfig& c, int32_t tp) {
  if (c.mla) return uint64_t{c.page_size} * c.mla_bytes;
  return uint64_t{c.page_size} * KvHeadsHeld(c, tp) * c.head_bytes;
}

// Offset inside a KV page of (token row t, held head hl, byte b).
uint64_t KvOffset(const ModelConfig& c, uint64_t held, uint64_t t, uint64_t hl, uint64_t b) {
  if (c.mla) return t * c.mla_bytes + b;
  if (c.layout == KVLayout::kNHD) return (t * held + hl) * c.head_bytes + b;
  return (hl * c.page_size + t) * c.head_bytes + b;
}

uint64_t StateItemBytes(const StateTensorSpec& s, int32_t tp) {
  if (s.split_dim < 0) return s.unit_bytes;
  if (s.split_units > 0) return s.rows * HeldUnits(s.split_units, tp, 0).count * s.unit_bytes;
  return s.rows * (s.unit_bytes / static_cast<uint64_t>(tp));
}

// Calls fn(offset in item, value) for every byte of state item `pos` of tensor `g` on a rank.
template <typename Fn>
void ForStateItem(const StateTensorSpec& s, int32_t g, int32_t tp, int32_t rank, uint64_t pos,
                  Fn fn) {
  if (s.split_dim < 0) {
    for (uint64_t b = 0; b < s.unit_bytes; ++b) fn(b, Pattern(3, g, pos, 0, 0, b));
    return;
  }
  if (s.split_units > 0) {
    const Held h = HeldUnits(s.split_units, tp, rank);
    for (uint64_t r = 0; r < s.rows; ++r) {
      for (uint64_t u = 0; u < h.count; ++u) {
        for (uint64_t b = 0; b < s.unit_bytes; ++b) {
          fn((r * h.count + u) * s.unit_bytes + b, Pattern(3, g, pos, r, h.start + u, b));
        }
      }
    }
    return;
  }
  const uint64_t local = s.unit_bytes / static_cast<uint64_t>(tp);
  for (uint64_t r = 0; r < s.rows; ++r) {
    for (uint64_t u = 0; u < local; ++u) {
      fn(r * local + u, Pattern(3, g, pos, r, static_cast<uint64_t>(rank) * local + u, 0));
    }
  }
}

struct Rank {
  int32_t tp = 0;
  int32_t pp = 0;
  int32_t index = 0;
  SideLayout layout;
  Stage stage;
  // Memory and, on decode, how often each byte was written, and the expected image.
  std::vector<std::vector<uint8_t>> mem[3], count[3], want[3], want_count[3];
};

std::vector<Rank> MakeRanks(const ModelConfig& c, bool prefill) {
  const int32_t tp = prefill ? c.prefill_tp : c.decode_tp;
  const int32_t pp = prefill ? c.prefill_pp : c.decode_pp;
  std::vector<Rank> ranks;
  for (int32_t s = 0; s < pp; ++s) {
    for (int32_t t = 0; t < tp; ++t) {
      Rank r;
      r.tp = t;
      r.pp = s;
      r.index = t + s * tp;
      r.layout = MakeLayout(c, prefill, t, s);
      r.stage = StageOf(c, prefill, s);
      auto alloc = [&](auto& family, int kind) {
        for (const auto& b : family) {
          r.mem[kind].emplace_back(b.buffer_bytes, prefill ? kJunk : 0);
          if (!prefill) {
            r.count[kind].emplace_back(b.buffer_bytes, 0);
            r.want[kind].emplace_back(b.buffer_bytes, 0);
            r.want_count[kind].emplace_back(b.buffer_bytes, 0);
          }
        }
      };
      alloc(r.layout.kv, 0);
      alloc(r.layout.aux, 1);
      alloc(r.layout.state, 2);
      ranks.push_back(std::move(r));
    }
  }
  return ranks;
}

template <typename T>
const T* At(const std::vector<T>& v, int32_t i) {
  return i >= 0 && i < static_cast<int32_t>(v.size()) ? &v[i] : nullptr;
}

// Writes the pattern of one rank (prefill: into mem; decode: into want, with want_count 1).
void Paint(const ModelConfig& c, bool prefill, const Request& req, Rank* r) {
  const int32_t tp = prefill ? c.prefill_tp : c.decode_tp;
  auto put = [&](int kind, size_t buf, uint64_t off, uint8_t v) {
    auto& target = prefill ? r->mem[kind][buf] : r->want[kind][buf];
    if (off >= target.size()) return;  // an invalid index: the planner must reject it
    target[off] = v;
    if (!prefill) r->want_count[kind][buf][off] = 1;
  };
  const auto* pages = At(prefill ? req.src_pages : req.dst_pages, r->index);
  const int32_t kinds = c.mla ? 1 : 2;
  const int32_t nl = r->stage.num_layers;
  const uint64_t item = KvItemBytes(c, tp);
  const Held heads = c.mla ? Held{0, 1} : HeldUnits(static_cast<uint64_t>(c.kv_heads), tp, r->tp);
  const uint64_t head_bytes = c.mla ? c.mla_bytes : c.head_bytes;
  for (int32_t kv = 0; kv < kinds && pages; ++kv) {
    for (int32_t i = 0; i < nl; ++i) {
      const size_t buf = static_cast<size_t>(kv * nl + i);
      if (buf >= r->layout.kv.size()) continue;
      const int32_t layer = r->stage.start_layer + i;
      for (size_t pos = 0; pos < pages->size(); ++pos) {
        const int64_t page = (*pages)[pos];
        if (page < 0) continue;
        for (uint64_t t = 0; t < c.page_size; ++t) {
          const uint64_t token = pos * c.page_size + t;
          for (uint64_t hl = 0; hl < heads.count; ++hl) {
            for (uint64_t b = 0; b < head_bytes; ++b) {
              put(0, buf, page * item + KvOffset(c, heads.count, t, hl, b),
                  Pattern(1, layer, kv, token, heads.start + hl, b));
            }
          }
        }
      }
    }
  }
  const auto* aux = At(prefill ? req.src_aux : req.dst_aux, r->index);
  const auto* aux_other = At(prefill ? req.dst_aux : req.src_aux, 0);
  if (aux && *aux >= 0 && aux_other && *aux_other >= 0) {
    for (size_t a = 0; a < r->layout.aux.size(); ++a) {
      const uint64_t item_bytes = r->layout.aux[a].item_bytes;
      for (uint64_t b = 0; b < item_bytes; ++b) {
        put(1, a, static_cast<uint64_t>(*aux) * item_bytes + b, Pattern(2, a, b, 0, 0, 0));
      }
    }
  }
  const auto* states = At(prefill ? req.src_state : req.dst_state, r->index);
  // Decode expects state only where both sides name some (a side naming none skips the family,
  // planner::AlignStateLists); lists of other lengths are not compared (StateListsAgree).
  bool src_any = false;
  for (const auto& l : req.src_state) src_any |= !l.empty();
  if (!prefill && !src_any) states = nullptr;
  for (int32_t k = 0; k < r->stage.num_states && states; ++k) {
    const int32_t g = r->stage.state_start + k;
    if (g >= static_cast<int32_t>(c.state.size()) ||
        k >= static_cast<int32_t>(r->layout.state.size())) {
      continue;
    }
    const StateTensorSpec& spec = c.state[g];
    const uint64_t item_bytes = StateItemBytes(spec, tp);
    for (size_t pos = 0; pos < states->size(); ++pos) {
      const int64_t index = (*states)[pos];
      if (index < 0) continue;
      ForStateItem(spec, g, tp, r->tp, pos, [&](uint64_t off, uint8_t v) {
        put(2, k, static_cast<uint64_t>(index) * item_bytes + off, v);
      });
    }
  }
}

const std::vector<BufferDesc>* Family(const SideLayout& l, RegionKind kind,
                                      std::vector<BufferDesc>* scratch) {
  switch (kind) {
    case RegionKind::kKv: return &l.kv;
    case RegionKind::kAux: return &l.aux;
    case RegionKind::kState:
      scratch->clear();
      for (const auto& s : l.state) scratch->push_back({s.item_bytes, s.buffer_bytes});
      return scratch;
  }
  return nullptr;
}

bool InRegion(const std::vector<BufferDesc>& family, uint32_t buffer, uint64_t offset,
              uint64_t length) {
  return buffer < family.size() && length > 0 && offset <= family[buffer].buffer_bytes &&
         length <= family[buffer].buffer_bytes - offset;
}

std::string Str(const std::vector<RankId>& ranks) {
  std::ostringstream os;
  os << "{";
  for (const RankId& r : ranks) os << " (tp " << r.tp_rank << ", pp " << r.pp_rank << ")";
  os << " }";
  return os.str();
}

bool StagesTalk(const ModelConfig& c, int32_t prefill_pp, int32_t decode_pp) {
  if (c.decode_pp == 1) return true;
  if (c.decode_pp == c.prefill_pp) return prefill_pp == decode_pp;
  return true;  // an invalid combination: every pair must be refused
}

}  // namespace

SideLayout MakeLayout(const ModelConfig& c, bool prefill, int32_t tp_rank, int32_t pp_rank) {
  const int32_t tp = prefill ? c.prefill_tp : c.decode_tp;
  const Stage stage = StageOf(c, prefill, pp_rank);
  SideLayout l;
  l.tp_size = tp;
  l.tp_rank = tp_rank;
  l.pp_size = prefill ? c.prefill_pp : c.decode_pp;
  l.pp_rank = pp_rank;
  l.total_layers = c.total_layers();
  l.start_layer = stage.start_layer;
  l.total_kv_heads = c.kv_heads;
  l.kv_heads = static_cast<int32_t>(KvHeadsHeld(c, tp));
  l.page_size = c.page_size;
  l.layout = c.layout;
  l.is_mla = c.mla;
  const uint64_t item = KvItemBytes(c, tp);
  const int32_t buffers = (c.mla ? 1 : 2) * stage.num_layers;
  for (int32_t i = 0; i < buffers; ++i) {
    l.kv.push_back({item, item * static_cast<uint64_t>(c.kv_pool_pages)});
  }
  for (uint32_t a : c.aux_item_bytes) {
    l.aux.push_back({a, uint64_t{a} * static_cast<uint64_t>(c.aux_slots)});
  }
  l.state_type = c.state_type;
  l.state_start = stage.state_start;
  for (int32_t k = 0; k < stage.num_states; ++k) {
    const int32_t g = stage.state_start + k;
    if (g >= static_cast<int32_t>(c.state.size())) break;
    const StateTensorSpec& spec = c.state[g];
    StateBufferDesc s;
    s.item_bytes = StateItemBytes(spec, tp);
    s.buffer_bytes = s.item_bytes * static_cast<uint64_t>(c.state_pool);
    s.split_dim = spec.split_dim;
    s.rows = spec.rows;
    s.split_units = spec.split_units;
    l.state.push_back(s);
  }
  return l;
}

// Whether every non-empty state list of the request (both sides, every rank) has one length:
// then each position pairs with the same position on the other side. Lists whose lengths
// differ pair by the kind's drift rule per (prefill, decode) pair, which the reference does not
// model: their state bytes are not compared (the writes must still stay inside their regions).
bool StateListsAgree(const Request& req) {
  size_t len = 0;
  bool any = false;
  for (const auto* side : {&req.src_state, &req.dst_state}) {
    for (const auto& l : *side) {
      if (l.empty()) continue;
      if (any && l.size() != len) return false;
      any = true;
      len = l.size();
    }
  }
  bool src_all = true, dst_all = true;  // every rank of the side names state, or none does
  bool src_none = true, dst_none = true;
  for (const auto& l : req.src_state) (l.empty() ? src_all : src_none) = false;
  for (const auto& l : req.dst_state) (l.empty() ? dst_all : dst_none) = false;
  return (src_all || src_none) && (dst_all || dst_none);
}

RunResult RunModel(const ModelConfig& c, const Request& req) {
  RunResult res;
  res.accepted = true;
  auto reject = [&](const Status& s) {
    if (res.accepted) res.first_error = s;
    res.accepted = false;
  };
  auto fail = [&](const std::string& what) {
    if (res.failure.empty()) res.failure = what;
  };
  // Index lists that repeat an index are refused per request, not per chunk: decode checks its
  // TransferInfo (CheckDistinct), and a prefill page cannot hold two parts of one request.
  std::vector<int32_t> scratch;
  for (const auto* lists : {&req.src_pages, &req.dst_pages, &req.src_state, &req.dst_state}) {
    for (const auto& list : *lists) {
      if (Status s = CheckDistinct(list, "index", "request", &scratch); !s.ok()) reject(s);
    }
  }
  std::vector<Rank> prefill = MakeRanks(c, true);
  std::vector<Rank> decode = MakeRanks(c, false);
  for (Rank& r : prefill) Paint(c, true, req, &r);

  // Plans for every pair whose stages talk.
  std::map<std::pair<int32_t, int32_t>, PairPlan> plans;
  for (const Rank& d : decode) {
    for (const Rank& p : prefill) {
      if (!StagesTalk(c, p.pp, d.pp)) continue;
      auto plan = MakePairPlan(p.layout, d.layout);
      if (!plan.ok()) {
        reject(plan.status());
        continue;
      }
      plans.emplace(std::pair{p.index, d.index}, std::move(*plan));
    }
  }

  // Decode checks that its stages' extents cover it (a per-pair plan cannot).
  for (const Rank& d : decode) {
    std::vector<StageExtent> stages;
    for (const Rank& p : prefill) {
      if (p.tp == 0 && StagesTalk(c, p.pp, d.pp)) stages.push_back(ExtentOf(p.layout));
    }
    if (Status s = CheckStageCoverage(d.layout, stages); !s.ok()) reject(s);
  }

  // The pairing decisions must agree with the plans.
  if (res.accepted && !decode.empty()) {
    // Each decode stage derives its own topology (its stage's state tensors); decode PP 1 has
    // one. Every rank of a stage must derive the same.
    std::vector<Topology> topos;
    for (const Rank& d : decode) {
      auto t = MakeTopology(d.layout, c.prefill_tp, c.prefill_pp);
      if (!t.ok()) {
        fail("every pair was planned but MakeTopology failed: " + t.status().ToString());
        break;
      }
      if (d.tp == 0) {
        topos.push_back(*t);
      } else if (!(*t == topos.back())) {
        fail("decode ranks of one stage disagree on the topology");
      }
    }
    if (res.failure.empty()) {
      auto topo_of = [&](const Rank& p) { return &topos[c.decode_pp == 1 ? 0 : p.pp]; };
      for (const Rank& p : prefill) {
        std::vector<RankId> active;
        for (const Rank& d : decode) {
          auto it = plans.find({p.index, d.index});
          if (it != plans.end() && it->second.active) active.push_back({d.tp, d.pp});
        }
        std::sort(active.begin(), active.end());
        auto targets = TargetsForPrefillRank(*topo_of(p), {p.tp, p.pp});
        if (!targets.ok() || *targets != active) {
          fail("prefill (tp " + std::to_string(p.tp) + ", pp " + std::to_string(p.pp) +
               ") targets " + (targets.ok() ? Str(*targets) : targets.status().ToString()) +
               " but plans write to " + Str(active));
        }
        auto required = RequiredDstInfoNum(*topo_of(p), {p.tp, p.pp});
        if (!required.ok() || *required != std::max<size_t>(1, active.size())) {
          fail("required_dst_info_num disagrees with the targets");
        }
        if (active.empty()) {
          ++res.dummies;
          auto owner = DummyOwner(*topo_of(p), {p.tp, p.pp});
          if (!owner.ok()) {
            fail("dummy without owner: " + owner.status().ToString());
          } else {
            auto dummies = DummyPrefillRanks(*topo_of(p), *owner);
            if (!dummies.ok() ||
                std::count(dummies->begin(), dummies->end(), RankId{p.tp, p.pp}) != 1) {
              fail("a dummy's owner does not list it");
            }
          }
        } else if (DummyOwner(*topo_of(p), {p.tp, p.pp}).ok()) {
          fail("a prefill rank with targets has a dummy owner");
        }
      }
      for (const Rank& d : decode) {
        std::vector<RankId> active;
        int32_t aux_writers = 0;
        RankId aux_writer;
        for (const Rank& p : prefill) {
          auto it = plans.find({p.index, d.index});
          if (it == plans.end()) continue;
          if (it->second.active) active.push_back({p.tp, p.pp});
          if (it->second.writes_aux) {
            ++aux_writers;
            aux_writer = {p.tp, p.pp};
          }
        }
        res.active_pairs += static_cast<int32_t>(active.size());
        std::sort(active.begin(), active.end());
        auto expected = ExpectedPrefillRanks(topos[static_cast<size_t>(d.pp)], {d.tp, d.pp});
        if (!expected.ok() || *expected != active) {
          fail("decode (tp " + std::to_string(d.tp) + ", pp " + std::to_string(d.pp) +
               ") expects " + (expected.ok() ? Str(*expected) : expected.status().ToString()) +
               " but plans write from " + Str(active));
        }
        auto dummies = DummyPrefillRanks(topos[static_cast<size_t>(d.pp)], {d.tp, d.pp});
        if (!dummies.ok()) fail("DummyPrefillRanks failed: " + dummies.status().ToString());
        for (const RankId& p : dummies.ok() ? *dummies : std::vector<RankId>{}) {
          auto owner = DummyOwner(topos[static_cast<size_t>(d.pp)], p);
          if (!owner.ok() || !(*owner == RankId{d.tp, d.pp})) fail("a dummy has two owners");
        }
        if (!c.aux_item_bytes.empty()) {
          auto writer = AuxWriter(topos[static_cast<size_t>(d.pp)], {d.tp, d.pp});
          if (aux_writers != 1 || !writer.ok() || !(*writer == aux_writer)) {
            fail("decode (tp " + std::to_string(d.tp) + ", pp " + std::to_string(d.pp) + ") has " +
                 std::to_string(aux_writers) + " aux writers");
          }
        }
      }
    }
  }

  // Every chunk, every pair.
  PlanOutput out;
  std::vector<BufferDesc> scratch_p, scratch_d;
  const int64_t ps = c.page_size;
  const int64_t request_pages = (req.num_tokens + ps - 1) / ps;
  int64_t t0 = 0;
  for (size_t k = 0; k < req.chunk_tokens.size(); ++k) {
    const bool last = k + 1 == req.chunk_tokens.size();
    const int64_t tokens = req.chunk_tokens[k];
    for (auto& [key, plan] : plans) {
      Rank& p = prefill[static_cast<size_t>(key.first)];
      Rank& d = decode[static_cast<size_t>(key.second)];
      auto slice = [&](const std::vector<std::vector<int32_t>>& lists,
                       int32_t index) -> std::span<const int32_t> {
        const auto* list = At(lists, index);
        if (!list) return {};
        const auto size = static_cast<int64_t>(list->size());
        const int64_t begin = std::clamp<int64_t>(t0 / ps, 0, size);
        const int64_t end = std::clamp<int64_t>((t0 + tokens + ps - 1) / ps, begin, size);
        return std::span<const int32_t>(*list).subspan(static_cast<size_t>(begin),
                                                       static_cast<size_t>(end - begin));
      };
      ChunkInput in;
      in.pages.src_pages = slice(req.src_pages, p.index);
      in.pages.dst_pages = slice(req.dst_pages, d.index);
      in.pages.is_last = last;
      in.pages.num_tokens = tokens;
      if (const auto* a = At(req.src_aux, p.index)) in.tail.src_aux = *a;
      if (const auto* a = At(req.dst_aux, d.index)) in.tail.dst_aux = *a;
      if (const auto* s = At(req.src_state, p.index)) in.tail.src_state = *s;
      if (const auto* s = At(req.dst_state, d.index)) in.tail.dst_state = *s;
      in.tail.request_pages = request_pages;
      Status s = PlanChunkWrites(plan, in, &out);
      if (!s.ok()) {
        reject(s);
        continue;
      }
      if (!plan.active && !out.writes.empty()) fail("an inactive pair planned writes");
      uint64_t bytes = 0;
      for (size_t w = 0; w < out.writes.size(); ++w) {
        const PlannedWrite& op = out.writes[w];
        const auto& src = *Family(p.layout, op.kind, &scratch_p);
        const auto& dst = *Family(d.layout, op.kind, &scratch_d);
        if (!InRegion(src, op.local_buffer, op.local_offset, op.length) ||
            !InRegion(dst, op.remote_buffer, op.remote_offset, op.length)) {
          fail(std::string("a ") + RegionKindName(op.kind) + " write leaves its region: prefill " +
               "buffer " + std::to_string(op.local_buffer) + " +" +
               std::to_string(op.local_offset) + ", decode buffer " +
               std::to_string(op.remote_buffer) + " +" + std::to_string(op.remote_offset) +
               ", length " + std::to_string(op.length));
          continue;
        }
        if (w > 0) {
          const PlannedWrite& prev = out.writes[w - 1];
          if (prev.kind == op.kind && prev.local_buffer == op.local_buffer &&
              prev.remote_buffer == op.remote_buffer &&
              prev.local_offset + prev.length == op.local_offset &&
              prev.remote_offset + prev.length == op.remote_offset) {
            fail("two consecutive writes are contiguous on both sides but were not merged");
          }
        }
        const int kind = static_cast<int>(op.kind);
        const uint8_t* from = p.mem[kind][op.local_buffer].data() + op.local_offset;
        uint8_t* to = d.mem[kind][op.remote_buffer].data() + op.remote_offset;
        std::memcpy(to, from, op.length);
        uint8_t* n = d.count[kind][op.remote_buffer].data() + op.remote_offset;
        for (uint64_t b = 0; b < op.length; ++b)
          n[b] = static_cast<uint8_t>(std::min(n[b] + 1, 200));
        bytes += op.length;
      }
      if (bytes != out.bytes) fail("PlanOutput::bytes disagrees with the writes");
      res.writes += out.writes.size();
      res.bytes += bytes;
    }
    t0 += tokens;
  }
  if (!res.accepted || !res.failure.empty()) return res;

  // Every expected byte exactly once, with its value; nothing else.
  static const char* kFamilies[] = {"kv", "aux", "state"};
  for (Rank& d : decode) {
    Paint(c, false, req, &d);
    for (int kind = 0; kind < 3; ++kind) {
      if (kind == 2 && !StateListsAgree(req)) continue;
      for (size_t b = 0; b < d.mem[kind].size(); ++b) {
        const auto& mem = d.mem[kind][b];
        const auto& want = d.want[kind][b];
        const auto& n = d.count[kind][b];
        const auto& want_n = d.want_count[kind][b];
        if (mem == want && n == want_n) continue;
        for (size_t off = 0; off < mem.size(); ++off) {
          if (mem[off] == want[off] && n[off] == want_n[off]) continue;
          fail(std::string("decode (tp ") + std::to_string(d.tp) + ", pp " + std::to_string(d.pp) +
               ") " + kFamilies[kind] + " buffer " + std::to_string(b) + " byte " +
               std::to_string(off) + ": written " + std::to_string(n[off]) + " times (want " +
               std::to_string(want_n[off]) + "), value " + std::to_string(mem[off]) + " (want " +
               std::to_string(want[off]) + ")");
          return res;
        }
      }
    }
  }
  return res;
}

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
