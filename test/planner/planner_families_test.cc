// Several state families in one request (SPEC R11.2) and the index pairing rule of each kind
// (planner::AlignStateLists). Plans are applied to simulated buffers and every byte of decode's
// state is compared with what the model holds, so a family's writes landing in another family's
// buffers, a slice at the wrong offset or a skipped family all show up as wrong bytes.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

TEST_CASE("families: each kind pairs its two index lists by its own rule") {
  auto pairs = [](StateType t, size_t s, size_t d, int64_t pages = -1) {
    return AlignStateLists(t, s, d, pages);
  };
  // One request-scoped slot.
  for (StateType t : {StateType::kMamba, StateType::kC128State}) {
    CAPTURE(StateTypeName(t));
    REQUIRE(pairs(t, 1, 1).ok());
    CHECK(pairs(t, 1, 1)->count == 1);
    CHECK(pairs(t, 2, 2).status().code() == StatusCode::kInvalidArgument);
    CHECK(pairs(t, 0, 1)->count == 0);  // a side naming none: the family is skipped
  }
  // Ring rows pair by position: equal lengths only.
  CHECK(pairs(StateType::kSwaRing, 5, 5)->count == 5);
  Status ring = pairs(StateType::kSwaRing, 5, 4).status();
  CHECK(ring.code() == StatusCode::kInvalidArgument);
  CHECK(ring.message().find("swa_ring") != std::string::npos);
  CHECK(ring.message().find("5 prefill indices, 4 decode indices") != std::string::npos);
  // Paged kinds tolerate one page of drift, pairing the first pages of the shorter length.
  for (StateType t : {StateType::kSwa, StateType::kNsa, StateType::kMinimaxIndexK}) {
    CAPTURE(StateTypeName(t));
    auto a = pairs(t, 4, 5);
    REQUIRE(a.ok());
    CHECK(a->count == 4);
    CHECK(a->src_begin == 0);
    CHECK(a->dst_begin == 0);
    CHECK(pairs(t, 5, 4)->count == 4);
    CHECK(pairs(t, 3, 5).status().code() == StatusCode::kInvalidArgument);
  }
  // Against the request's pages (decode's prefix included).
  CHECK(pairs(StateType::kSwa, 3, 3, 2).status().code() == StatusCode::kInvalidArgument);
  CHECK(pairs(StateType::kSwa, 2, 2, 6).ok());
  CHECK(pairs(StateType::kNsa, 6, 6, 6).ok());
  CHECK(pairs(StateType::kNsa, 5, 6, 6).ok());
  CHECK(pairs(StateType::kNsa, 4, 4, 6).status().code() == StatusCode::kInvalidArgument);
}

// One rank of a tiny hybrid model: one layer (K, V), 2 KV heads of 4 bytes, 2-token pages, and
// the state families below. Split families split on dimension 0 into 4 units.
struct FamilySpec {
  StateType type;
  bool split;           // split across TP (4 units of 2 bytes), else replicated 6-byte items
  uint32_t items = 16;  // slots / pages / rows per buffer
  int buffers = 1;
};

constexpr uint64_t kUnits = 4, kUnitBytes = 2, kWholeBytes = 6;

KVArgs RankArgs(const std::vector<FamilySpec>& families, int32_t tp_size, int32_t tp_rank) {
  KVArgs a;
  a.page_size = 2;
  a.kv_layout = KVLayout::kHND;
  a.kv_head_num = std::max(1, 2 / tp_size);
  a.fingerprint.num_layers = 1;
  a.fingerprint.num_kv_heads = 2;
  a.parallel.tp_size = tp_size;
  a.parallel.tp_rank = tp_rank;
  const uint64_t page = 2 * 4 * static_cast<uint64_t>(a.kv_head_num);
  for (int i = 0; i < 2; ++i) {
    a.kv.ptrs.push_back(0x1000);
    a.kv.lens.push_back(page * 8);
    a.kv.item_lens.push_back(page);
  }
  for (const FamilySpec& f : families) {
    StateFamily s;
    s.type = f.type;
    for (int b = 0; b < f.buffers; ++b) {
      const uint64_t item =
          f.split ? kUnits / static_cast<uint64_t>(tp_size) * kUnitBytes : kWholeBytes;
      s.buffers.ptrs.push_back(0x2000);
      s.buffers.lens.push_back(item * f.items);
      s.buffers.item_lens.push_back(item);
      s.dim_per_tensor.push_back(f.split ? 0 : -1);
      s.item_rows.push_back(1);
      s.split_units.push_back(f.split ? kUnits : 0);
    }
    a.state_families.push_back(std::move(s));
  }
  return a;
}

SideLayout Layout(const std::vector<FamilySpec>& families, int32_t tp_size, int32_t tp_rank) {
  auto l = SideLayoutFromKVArgs(RankArgs(families, tp_size, tp_rank));
  REQUIRE(l.ok());
  REQUIRE(ValidateSideLayout(*l, "test").ok());
  return *l;
}

// The model's byte of family f, buffer b, for the request's entry `entry` of that family, at
// model-wide byte `byte` of the item (split families: unit-major over all TP ranks).
uint8_t ModelByte(size_t f, size_t b, size_t entry, uint64_t byte) {
  return static_cast<uint8_t>(17 * f + 31 * b + 7 * entry + 3 * byte + 1);
}

// Simulated state buffers of one rank (flat order, every family's buffers).
using Buffers = std::vector<std::vector<uint8_t>>;

Buffers Alloc(const SideLayout& l, uint8_t fill) {
  Buffers out;
  for (const StateBufferDesc& d : l.state) out.emplace_back(d.buffer_bytes, fill);
  return out;
}

// Fills prefill rank `rank`'s items of each family's entries with the model's bytes.
void FillPrefill(const std::vector<FamilySpec>& fams, const SideLayout& l, int32_t tp_size,
                 int32_t tp_rank, const std::vector<std::vector<int32_t>>& src, Buffers* mem) {
  const auto spans = l.Families();
  for (size_t f = 0; f < fams.size(); ++f) {
    for (uint32_t b = 0; b < spans[f].count; ++b) {
      const StateBufferDesc& d = l.state[spans[f].first + b];
      const uint64_t base =
          fams[f].split ? static_cast<uint64_t>(tp_rank) * kUnits / tp_size * kUnitBytes : 0;
      for (size_t e = 0; e < src[f].size(); ++e) {
        for (uint64_t k = 0; k < d.item_bytes; ++k) {
          (*mem)[spans[f].first + b][static_cast<uint64_t>(src[f][e]) * d.item_bytes + k] =
              ModelByte(f, b, e, base + k);
        }
      }
    }
  }
}

void Apply(const std::vector<PlannedWrite>& writes, const Buffers& src, Buffers* dst) {
  for (const PlannedWrite& w : writes) {
    REQUIRE(w.kind == RegionKind::kState);
    REQUIRE(w.local_offset + w.length <= src[w.local_buffer].size());
    REQUIRE(w.remote_offset + w.length <= (*dst)[w.remote_buffer].size());
    std::memcpy((*dst)[w.remote_buffer].data() + w.remote_offset,
                src[w.local_buffer].data() + w.local_offset, w.length);
  }
}

// Flattens per-family lists into (indices, counts).
struct Flat {
  std::vector<int32_t> indices;
  std::vector<uint32_t> counts;
};
Flat Flatten(const std::vector<std::vector<int32_t>>& lists) {
  Flat out;
  for (const auto& l : lists) {
    out.indices.insert(out.indices.end(), l.begin(), l.end());
    out.counts.push_back(static_cast<uint32_t>(l.size()));
  }
  return out;
}

// Moves one request's state from every prefill rank to decode rank `drank` and checks every
// byte of decode's state buffers: the paired entries hold the model's bytes, everything else
// still holds the fill byte. Returns the bytes that differ; `corrupt` (negative controls)
// changes each pair plan before it is used, as a planner bug would.
uint64_t Move(const std::vector<FamilySpec>& fams, int32_t ptp, int32_t dtp, int32_t drank,
              const std::vector<std::vector<int32_t>>& src,
              const std::vector<std::vector<int32_t>>& dst, int64_t request_pages,
              const std::function<void(PairPlan*)>& corrupt) {
  const SideLayout d = Layout(fams, dtp, drank);
  Buffers dmem = Alloc(d, 0xEE);
  const Flat fs = Flatten(src), fd = Flatten(dst);
  for (int32_t p = 0; p < ptp; ++p) {
    const SideLayout pl = Layout(fams, ptp, p);
    auto plan = MakePairPlan(pl, d);
    REQUIRE(plan.ok());
    if (!plan->active) continue;
    if (corrupt) corrupt(&*plan);
    Buffers pmem = Alloc(pl, 0x00);
    FillPrefill(fams, pl, ptp, p, src, &pmem);
    TailInput tail;
    tail.src_state = fs.indices;
    tail.src_state_counts = fs.counts;
    tail.dst_state = fd.indices;
    tail.dst_state_counts = fd.counts;
    tail.request_pages = request_pages;
    PlanOutput out;
    Status s = PlanTailWrites(*plan, tail, &out);
    REQUIRE(s.ok());
    if (corrupt) {
      // A corrupted plan may address past a buffer: clip, the bytes will tell.
      for (PlannedWrite& w : out.writes) {
        if (w.remote_buffer >= dmem.size() || w.local_buffer >= pmem.size()) {
          w.length = 0;
          w.local_buffer = w.remote_buffer = 0;
          w.local_offset = w.remote_offset = 0;
          continue;
        }
        const uint64_t dsize = dmem[w.remote_buffer].size(), psize = pmem[w.local_buffer].size();
        w.remote_offset = std::min(w.remote_offset, dsize);
        w.local_offset = std::min(w.local_offset, psize);
        w.length = std::min({w.length, dsize - w.remote_offset, psize - w.local_offset});
      }
    }
    Apply(out.writes, pmem, &dmem);
  }
  uint64_t wrong = 0;
  const auto spans = d.Families();
  for (size_t f = 0; f < fams.size(); ++f) {
    auto pairing = AlignStateLists(fams[f].type, src[f].size(), dst[f].size(), request_pages);
    REQUIRE(pairing.ok());
    for (uint32_t b = 0; b < spans[f].count; ++b) {
      const StateBufferDesc& desc = d.state[spans[f].first + b];
      const uint64_t base =
          fams[f].split ? static_cast<uint64_t>(drank) * kUnits / dtp * kUnitBytes : 0;
      const std::vector<uint8_t>& buf = dmem[spans[f].first + b];
      for (uint64_t item = 0; item < desc.buffer_bytes / desc.item_bytes; ++item) {
        // Which paired entry (if any) landed in this item.
        int64_t entry = -1;
        for (size_t e = 0; e < pairing->count; ++e) {
          if (dst[f][pairing->dst_begin + e] == static_cast<int32_t>(item)) {
            entry = static_cast<int64_t>(pairing->src_begin + e);
          }
        }
        for (uint64_t k = 0; k < desc.item_bytes; ++k) {
          const uint8_t want =
              entry < 0 ? 0xEE : ModelByte(f, b, static_cast<size_t>(entry), base + k);
          if (buf[item * desc.item_bytes + k] != want) {
            if (wrong == 0 && !corrupt) {
              FAIL_CHECK("family " << f << " (" << StateTypeName(fams[f].type) << ") buffer " << b
                                   << " item " << item << " byte " << k << ": "
                                   << int(buf[item * desc.item_bytes + k]) << ", want "
                                   << int(want));
            }
            ++wrong;
          }
        }
      }
    }
  }
  return wrong;
}

void MoveAndCheck(const std::vector<FamilySpec>& fams, int32_t ptp, int32_t dtp, int32_t drank,
                  const std::vector<std::vector<int32_t>>& src,
                  const std::vector<std::vector<int32_t>>& dst, int64_t request_pages) {
  CHECK(Move(fams, ptp, dtp, drank, src, dst, request_pages, {}) == 0);
}

TEST_CASE("families: two families, TP 2 -> 1 and 1 -> 2, byte for byte") {
  const std::vector<FamilySpec> fams = {{StateType::kMamba, true, 8, 2},
                                        {StateType::kSwa, false, 16, 1}};
  const std::vector<std::vector<int32_t>> src = {{3}, {9, 2, 5}};
  const std::vector<std::vector<int32_t>> dst = {{6}, {1, 11, 7}};
  SECTION("TP 2 -> 1") { MoveAndCheck(fams, 2, 1, 0, src, dst, 6); }
  SECTION("TP 1 -> 2, decode rank 0") { MoveAndCheck(fams, 1, 2, 0, src, dst, 6); }
  SECTION("TP 1 -> 2, decode rank 1") { MoveAndCheck(fams, 1, 2, 1, src, dst, 6); }
}

TEST_CASE("families: three families (DeepSeek-V4 shape: swa, swa_ring, c128_state)") {
  const std::vector<FamilySpec> fams = {{StateType::kSwa, false, 16, 2},
                                        {StateType::kSwaRing, false, 32, 1},
                                        {StateType::kC128State, false, 4, 1}};
  // SWA: decode's window list is one page longer (the drift SGLang's allocators can make).
  const std::vector<std::vector<int32_t>> src = {{4, 5}, {10, 11, 12, 13}, {2}};
  const std::vector<std::vector<int32_t>> dst = {{8, 0, 15}, {20, 21, 22, 23}, {3}};
  SECTION("TP 2 -> 1") { MoveAndCheck(fams, 2, 1, 0, src, dst, 4); }
  SECTION("TP 1 -> 2") {
    MoveAndCheck(fams, 1, 2, 0, src, dst, 4);
    MoveAndCheck(fams, 1, 2, 1, src, dst, 4);
  }
  SECTION("two nsa families (a DSA model with a draft model) and mamba") {
    const std::vector<FamilySpec> dsa = {{StateType::kNsa, false, 16, 2},
                                         {StateType::kNsa, false, 16, 1},
                                         {StateType::kMamba, true, 4, 1}};
    MoveAndCheck(dsa, 2, 1, 0, {{1, 2, 3}, {4, 5, 6}, {0}}, {{9, 8, 7}, {3, 2, 1}, {2}}, 3);
  }
}

// Negative controls: a planner that swapped two families' maps, or shifted a family's buffers,
// must fail the byte check above (so that its passing means something).
TEST_CASE("families: negative controls, swapped or shifted family maps are caught") {
  const std::vector<FamilySpec> fams = {{StateType::kSwa, false, 16, 1},
                                        {StateType::kNsa, false, 16, 1}};
  const std::vector<std::vector<int32_t>> src = {{4, 5}, {1, 2, 3}};
  const std::vector<std::vector<int32_t>> dst = {{8, 9}, {10, 11, 12}};
  CHECK(Move(fams, 1, 1, 0, src, dst, 3, {}) == 0);
  const uint64_t swapped = Move(fams, 1, 1, 0, src, dst, 3, [](PairPlan* p) {
    for (BufferMap& m : p->state) m.family = 1 - m.family;
  });
  CHECK(swapped > 0);
  const uint64_t shifted = Move(fams, 1, 1, 0, src, dst, 3, [](PairPlan* p) {
    for (BufferMap& m : p->state) m.dst_buffer = 1 - m.dst_buffer;
  });
  CHECK(shifted > 0);
}

TEST_CASE("families: refusals name the family and the kinds") {
  const std::vector<FamilySpec> fams = {{StateType::kMamba, true, 8, 1},
                                        {StateType::kSwa, false, 16, 1}};
  const SideLayout p = Layout(fams, 1, 0);
  // Negative control: decode declares the same families in the other order.
  const SideLayout swapped = Layout({fams[1], fams[0]}, 1, 0);
  Status s = MakePairPlan(p, swapped).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find("prefill mamba, swa, decode swa, mamba") != std::string::npos);
  // A missing family.
  CHECK(MakePairPlan(p, Layout({fams[0]}, 1, 0)).status().code() ==
        StatusCode::kFailedPrecondition);

  auto plan = MakePairPlan(p, Layout(fams, 1, 0));
  REQUIRE(plan.ok());
  PlanOutput out;
  const std::vector<int32_t> idx = {1, 2, 3};
  TailInput tail;
  tail.src_state = idx;
  tail.dst_state = idx;
  // Without counts, indices of two families cannot be told apart.
  s = PlanTailWrites(*plan, tail, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("without per-family counts") != std::string::npos);
  // Counts that do not add up.
  const std::vector<uint32_t> bad = {1, 1};
  tail.src_state_counts = bad;
  tail.dst_state_counts = bad;
  CHECK(PlanTailWrites(*plan, tail, &out).code() == StatusCode::kInvalidArgument);
  // Mamba with two slots: refused, naming the family.
  const std::vector<uint32_t> two_mamba = {2, 1};
  tail.src_state_counts = two_mamba;
  tail.dst_state_counts = two_mamba;
  s = PlanTailWrites(*plan, tail, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("state family 0") != std::string::npos);
  CHECK(out.writes.empty());
  // An index past the swa family's 16 items (mamba holds 8: the check is per family).
  const std::vector<int32_t> far = {1, 12};
  const std::vector<uint32_t> one_each = {1, 1};
  tail.src_state = far;
  tail.dst_state = far;
  tail.src_state_counts = one_each;
  tail.dst_state_counts = one_each;
  CHECK(PlanTailWrites(*plan, tail, &out).ok());
  const std::vector<int32_t> too_far = {1, 16};
  tail.dst_state = too_far;
  s = PlanTailWrites(*plan, tail, &out);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message().find("swa state") != std::string::npos);
}

TEST_CASE("families: the one-family shorthand and state_families plan the same writes") {
  KVArgs shorthand = RankArgs({{StateType::kMamba, true, 8, 2}}, 2, 1);
  KVArgs listed = shorthand;
  shorthand.state_type = StateType::kMamba;
  shorthand.state = listed.state_families[0].buffers;
  shorthand.state_dim_per_tensor = listed.state_families[0].dim_per_tensor;
  shorthand.state_item_rows = listed.state_families[0].item_rows;
  shorthand.state_split_units = listed.state_families[0].split_units;
  shorthand.state_families.clear();
  auto a = SideLayoutFromKVArgs(shorthand);
  auto b = SideLayoutFromKVArgs(listed);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->Families() == b->Families());
  const SideLayout d = Layout({{StateType::kMamba, true, 8, 2}}, 1, 0);
  auto pa = MakePairPlan(*a, d);
  auto pb = MakePairPlan(*b, d);
  REQUIRE(pa.ok());
  REQUIRE(pb.ok());
  const std::vector<int32_t> s = {2}, t = {5};
  PlanOutput oa, ob;
  TailInput tail;
  tail.src_state = s;
  tail.dst_state = t;
  REQUIRE(PlanTailWrites(*pa, tail, &oa).ok());
  REQUIRE(PlanTailWrites(*pb, tail, &ob).ok());
  CHECK(oa.writes == ob.writes);
  CHECK(!oa.writes.empty());
  // Both at once is refused.
  KVArgs both = listed;
  both.state_type = StateType::kMamba;
  CHECK(SideLayoutFromKVArgs(both).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
