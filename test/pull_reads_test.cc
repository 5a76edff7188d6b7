// Decode pull's one new piece of data-plane logic (issue #29): the planner's writes reversed into
// decode's reads (AppendReads). Plans for real layouts (TP 2 -> 1 NHD head slices, MLA, with aux
// and state) are applied to simulated memory twice: as prefill's writes (the push reference) and
// as decode's reads through the reversed op list. Decode's bytes must be identical, and not the
// fill. Negative controls: the op list used without reversing, and a read of the wrong page, both
// leave decode's bytes different from the reference.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "lib/core/transfer_layout.h"
#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace {

constexpr uint32_t kPageTokens = 2;
constexpr uint64_t kPages = 8;

// One side's memory: buffers per family, region id = 100 * family + index + 1 (so that a swapped
// family or side shows up as an unknown region).
struct Side {
  std::vector<std::vector<uint8_t>> kv, aux, state;
  std::vector<uint32_t> kv_ids, aux_ids, state_ids;
  uint32_t base = 0;
  RegionIds ids() const { return {kv_ids, aux_ids, state_ids}; }
  std::vector<uint8_t>* Region(uint32_t id) {
    for (auto [list, ids] :
         {std::pair{&kv, &kv_ids}, std::pair{&aux, &aux_ids}, std::pair{&state, &state_ids}}) {
      for (size_t i = 0; i < ids->size(); ++i) {
        if ((*ids)[i] == id) return &(*list)[i];
      }
    }
    return nullptr;
  }
};

// KVArgs of one rank (pointers are never read by the planner glue: it sees sizes only).
KVArgs Args(int32_t tp, int32_t rank, bool mla, const Side& side) {
  KVArgs a;
  a.page_size = kPageTokens;
  a.parallel.tp_size = tp;
  a.parallel.tp_rank = rank;
  a.is_mla = mla;
  a.kv_layout = KVLayout::kNHD;
  a.kv_head_num = mla ? 1 : 4 / tp;
  a.fingerprint = {1, mla ? 1 : 4, 4, 1, 1, "reads-test"};
  for (const auto& b : side.kv) {
    a.kv.ptrs.push_back(reinterpret_cast<uint64_t>(b.data()));
    a.kv.lens.push_back(b.size());
    a.kv.item_lens.push_back(b.size() / kPages);
  }
  for (const auto& b : side.aux) {
    a.aux.ptrs.push_back(reinterpret_cast<uint64_t>(b.data()));
    a.aux.lens.push_back(b.size());
    a.aux.item_lens.push_back(8);
  }
  if (!side.state.empty()) {
    a.state_type = StateType::kMamba;
    for (const auto& b : side.state) {
      a.state.ptrs.push_back(reinterpret_cast<uint64_t>(b.data()));
      a.state.lens.push_back(b.size());
      a.state.item_lens.push_back(16);
    }
  }
  return a;
}

Side MakeSide(int32_t tp, bool mla, uint32_t base, uint8_t fill) {
  Side s;
  s.base = base;
  const uint64_t page = kPageTokens * (mla ? 1 : 4 / tp) * 4;
  const int buffers = mla ? 1 : 2;
  for (int i = 0; i < buffers; ++i) s.kv.emplace_back(page * kPages, fill);
  s.aux.emplace_back(8 * 4, fill);
  s.state.emplace_back(16 * 4, fill);
  for (size_t i = 0; i < s.kv.size(); ++i) s.kv_ids.push_back(base + 1 + static_cast<uint32_t>(i));
  s.aux_ids = {base + 101};
  s.state_ids = {base + 201};
  return s;
}

void Fill(Side& s, uint8_t salt) {
  uint8_t v = salt;
  for (auto* list : {&s.kv, &s.aux, &s.state}) {
    for (auto& b : *list) {
      for (auto& x : b) x = v = static_cast<uint8_t>(v * 31 + 7);
    }
  }
}

// Applies `ops` as reads into `local` from `remote`; false if an op names a region the side
// does not have, or leaves it (the core and the backend would refuse it).
bool ApplyReads(const std::vector<spi::ReadOp>& ops, Side& local, Side& remote) {
  for (const spi::ReadOp& op : ops) {
    std::vector<uint8_t>* dst = local.Region(op.local_region);
    std::vector<uint8_t>* src = remote.Region(op.remote_region);
    if (dst == nullptr || src == nullptr || op.local_offset + op.length > dst->size() ||
        op.remote_offset + op.length > src->size()) {
      return false;
    }
    std::memcpy(dst->data() + op.local_offset, src->data() + op.remote_offset, op.length);
  }
  return true;
}

// What decode holds after a push of `chunk` (plus the tail) and after a pull of it.
struct Outcome {
  Side pushed, pulled;
  bool reads_valid = true;
};

enum class Mutation { kNone, kNotReversed, kWrongPage };

Outcome Run(int32_t prefill_tp, bool mla, Mutation mutation) {
  Side prefill = MakeSide(prefill_tp, mla, 1000, 0);
  Fill(prefill, 3);
  Outcome out{MakeSide(1, mla, 2000, 0xA5), MakeSide(1, mla, 2000, 0xA5)};
  auto mine = PlannerLayout(Args(prefill_tp, 0, mla, prefill), "prefill");
  auto theirs = PlannerLayout(Args(1, 0, mla, out.pulled), "decode");
  REQUIRE(mine.ok());
  REQUIRE(theirs.ok());
  auto plan = planner::MakePairPlan(*mine, *theirs);
  REQUIRE(plan.ok());
  REQUIRE(plan->active);
  std::vector<int32_t> src = {5, 1, 2};
  const std::vector<int32_t> dst = {0, 6, 3};
  planner::PlanOutput writes;
  REQUIRE(planner::PlanKvWrites(*plan, {src, dst, true}, &writes).ok());
  const std::vector<int32_t> sstate = {2}, dstate = {1};
  planner::TailInput tail;
  tail.src_aux = 3;
  tail.dst_aux = 1;
  tail.src_state = sstate;
  tail.dst_state = dstate;
  REQUIRE(planner::PlanTailWrites(*plan, tail, &writes).ok());
  REQUIRE(!writes.writes.empty());
  // The reference: prefill's writes land in decode's memory.
  for (const planner::PlannedWrite& w : writes.writes) {
    auto pick = [&](Side& s, uint32_t buffer) -> std::vector<uint8_t>& {
      return w.kind == planner::RegionKind::kAux     ? s.aux[buffer]
             : w.kind == planner::RegionKind::kState ? s.state[buffer]
                                                     : s.kv[buffer];
    };
    std::memcpy(pick(out.pushed, w.remote_buffer).data() + w.remote_offset,
                pick(prefill, w.local_buffer).data() + w.local_offset, w.length);
  }
  // Decode's reads.
  if (mutation == Mutation::kWrongPage) {
    src[1] = 4;  // decode reads prefill's page 4 where the chunk said page 1
    writes.writes.clear();
    REQUIRE(planner::PlanKvWrites(*plan, {src, dst, true}, &writes).ok());
  }
  std::vector<spi::ReadOp> reads;
  if (mutation == Mutation::kNotReversed) {
    // The bug the reversal prevents: prefill's side taken as the local one.
    AppendReads(writes.writes, prefill.ids(), out.pulled.ids(), &reads);
    out.reads_valid = ApplyReads(reads, prefill, out.pulled);
  } else {
    AppendReads(writes.writes, out.pulled.ids(), prefill.ids(), &reads);
    REQUIRE(reads.size() == writes.writes.size());
    out.reads_valid = ApplyReads(reads, out.pulled, prefill);
  }
  return out;
}

bool SameBytes(const Side& a, const Side& b) {
  return a.kv == b.kv && a.aux == b.aux && a.state == b.state;
}

TEST_CASE("pull reads: the reversed plan reads exactly what a push would write") {
  for (auto [tp, mla] : {std::pair{2, false}, std::pair{1, false}, std::pair{2, true}}) {
    CAPTURE(tp, mla);
    Outcome o = Run(tp, mla, Mutation::kNone);
    REQUIRE(o.reads_valid);
    CHECK(SameBytes(o.pushed, o.pulled));
    // Something moved: the reference differs from the untouched fill.
    CHECK(!SameBytes(o.pushed, MakeSide(1, mla, 2000, 0xA5)));
  }
}

TEST_CASE("pull reads negative controls: an op list not reversed, a read of the wrong page") {
  for (auto [tp, mla] : {std::pair{2, false}, std::pair{2, true}}) {
    CAPTURE(tp, mla);
    Outcome o = Run(tp, mla, Mutation::kNotReversed);
    // Either refused (regions of the wrong side) or decode's bytes are not the push's.
    CHECK((!o.reads_valid || !SameBytes(o.pushed, o.pulled)));
    Outcome w = Run(tp, mla, Mutation::kWrongPage);
    REQUIRE(w.reads_valid);
    CHECK(!SameBytes(w.pushed, w.pulled));
  }
}

}  // namespace
}  // namespace v1
}  // namespace pdlib
