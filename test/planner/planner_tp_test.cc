// M:N tensor parallelism (SPEC R5.4, R5.5): who talks to whom, how a head slice becomes writes,
// and the exhaustive grid over prefill TP x decode TP x kv heads x page size x layout.
#include <catch2/catch.hpp>

#include "lib/planner/planner.h"
#include "test/planner/grid.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

std::vector<RankId> Tp(std::initializer_list<int32_t> ranks) {
  std::vector<RankId> out;
  for (int32_t r : ranks) out.push_back({r, 0});
  return out;
}

Topology Topo(int32_t prefill_tp, int32_t decode_tp, uint64_t heads) {
  return Topology{prefill_tp, decode_tp, 1, 1, {heads}};
}

TEST_CASE("tp N:1: prefill TP 4 -> decode TP 2 with 32 kv heads, as the reference system") {
  const Topology t = Topo(4, 2, 32);
  CHECK(*TargetsForPrefillRank(t, {0, 0}) == Tp({0}));
  CHECK(*TargetsForPrefillRank(t, {1, 0}) == Tp({0}));
  CHECK(*TargetsForPrefillRank(t, {2, 0}) == Tp({1}));
  CHECK(*TargetsForPrefillRank(t, {3, 0}) == Tp({1}));
  CHECK(*ExpectedPrefillRanks(t, {0, 0}) == Tp({0, 1}));
  CHECK(*ExpectedPrefillRanks(t, {1, 0}) == Tp({2, 3}));
  CHECK(*RequiredDstInfoNum(t, {3, 0}) == 1);
  CHECK(DummyPrefillRanks(t, {0, 0})->empty());
  CHECK(*AuxWriter(t, {1, 0}) == RankId{2, 0});
}

TEST_CASE("tp 1:N: one prefill rank writes disjoint head ranges into four decode ranks") {
  const Topology t = Topo(1, 4, 8);
  CHECK(*TargetsForPrefillRank(t, {0, 0}) == Tp({0, 1, 2, 3}));
  CHECK(*RequiredDstInfoNum(t, {0, 0}) == 4);
  for (int32_t d = 0; d < 4; ++d) CHECK(*ExpectedPrefillRanks(t, {d, 0}) == Tp({0}));
}

TEST_CASE("tp GQA: replicated heads are sent by one replica, the others are dummies") {
  // 2 kv heads on prefill TP 4: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1.
  const Topology t = Topo(4, 1, 2);
  CHECK(*ExpectedPrefillRanks(t, {0, 0}) == Tp({0, 2}));
  CHECK(*DummyPrefillRanks(t, {0, 0}) == Tp({1, 3}));
  CHECK(TargetsForPrefillRank(t, {1, 0})->empty());
  CHECK(*DummyOwner(t, {3, 0}) == RankId{0, 0});
  CHECK(*RequiredDstInfoNum(t, {1, 0}) == 1);
  CHECK(DummyOwner(t, {0, 0}).status().code() == StatusCode::kFailedPrecondition);

  // Equal TP with replication stays 1:1.
  const Topology same = Topo(4, 4, 2);
  for (int32_t r = 0; r < 4; ++r) CHECK(*ExpectedPrefillRanks(same, {r, 0}) == Tp({r}));

  // Replicas on decode: each prefill replica serves the decode ranks inside its share.
  const Topology wide = Topo(2, 8, 2);
  for (int32_t d = 0; d < 8; ++d) CHECK(*ExpectedPrefillRanks(wide, {d, 0}) == Tp({d / 4}));
  CHECK(*RequiredDstInfoNum(wide, {1, 0}) == 4);
}

TEST_CASE("tp MLA: one prefill rank sends to each decode rank, the others are dummies") {
  const Topology n1 = Topo(4, 2, 1);  // MLA: one replicated unit
  CHECK(*ExpectedPrefillRanks(n1, {0, 0}) == Tp({0}));
  CHECK(*ExpectedPrefillRanks(n1, {1, 0}) == Tp({2}));
  CHECK(*DummyPrefillRanks(n1, {0, 0}) == Tp({1}));
  CHECK(*DummyPrefillRanks(n1, {1, 0}) == Tp({3}));
  const Topology one_n = Topo(2, 4, 1);
  CHECK(*TargetsForPrefillRank(one_n, {0, 0}) == Tp({0, 1}));
  CHECK(*TargetsForPrefillRank(one_n, {1, 0}) == Tp({2, 3}));
}

TEST_CASE("tp topology rejects heads that do not split over TP") {
  CHECK(ValidateTopology(Topo(3, 1, 8)).code() == StatusCode::kInvalidArgument);
  CHECK(ValidateTopology(Topo(8, 1, 3)).code() == StatusCode::kInvalidArgument);
  CHECK(ExpectedPrefillRanks(Topo(2, 2, 2), {2, 0}).status().code() == StatusCode::kOutOfRange);
}

// One layer, 8 heads of 4 bytes, 16-token pages, prefill TP `ptp` -> decode TP `dtp`.
PairPlan Plan(int32_t ptp, int32_t dtp, int32_t prank, int32_t drank, KVLayout layout) {
  ModelConfig c = KvConfig(ptp, dtp, 8, 16, layout);
  c.head_bytes = 4;
  c.stage_layers = {1};
  c.kv_pool_pages = 8;
  auto plan = MakePairPlan(MakeLayout(c, true, prank, 0), MakeLayout(c, false, drank, 0));
  REQUIRE(plan.ok());
  return *plan;
}

TEST_CASE("tp 2->1 NHD slices heads into page_size pieces per page and HND into one") {
  const std::vector<int32_t> src = {0, 1, 2}, dst = {3, 4, 5};
  PlanOutput out;
  ChunkInput in;
  in.pages = {src, dst, false, 48};

  const PairPlan nhd = Plan(2, 1, 1, 0, KVLayout::kNHD);
  REQUIRE(PlanChunkWrites(nhd, in, &out).ok());
  CHECK(out.writes.size() == 2 * 3 * 16);  // K and V, 3 pages, 16 tokens
  const uint64_t dst_item = 16 * 8 * 4, src_item = 16 * 4 * 4;
  CHECK(out.writes[0] == PlannedWrite{RegionKind::kKv, 0, 0, 0, 3 * dst_item + 4 * 4, 16});
  CHECK(out.writes[1] == PlannedWrite{RegionKind::kKv, 0, 16, 0, 3 * dst_item + 32 + 16, 16});
  CHECK(out.bytes == 2 * 3 * src_item);

  const PairPlan hnd = Plan(2, 1, 1, 0, KVLayout::kHND);
  REQUIRE(PlanChunkWrites(hnd, in, &out).ok());
  REQUIRE(out.writes.size() == 2 * 3);
  CHECK(out.writes[0] == PlannedWrite{RegionKind::kKv, 0, 0, 0, 3 * dst_item + 4 * 16 * 4, 256});
  CHECK(out.writes[1] ==
        PlannedWrite{RegionKind::kKv, 0, src_item, 0, 4 * dst_item + 4 * 16 * 4, 256});

  // 1:1: whole pages, the run of three pages is one write per buffer.
  const PairPlan same = Plan(1, 1, 0, 0, KVLayout::kNHD);
  REQUIRE(PlanChunkWrites(same, in, &out).ok());
  REQUIRE(out.writes.size() == 2);
  CHECK(out.writes[1] == PlannedWrite{RegionKind::kKv, 1, 0, 1, 3 * dst_item, 3 * dst_item});

  // 1:2 HND: decode rank 1 gets heads 4..7 from the middle of each prefill page.
  const PairPlan split = Plan(1, 2, 0, 1, KVLayout::kHND);
  REQUIRE(PlanChunkWrites(split, in, &out).ok());
  REQUIRE(out.writes.size() == 2 * 3);
  CHECK(out.writes[0] == PlannedWrite{RegionKind::kKv, 0, 4 * 16 * 4, 0, 3 * src_item, 256});
}

TEST_CASE("tp grid NHD: prefill TP x decode TP x kv heads x page size") {
  uint64_t writes = 0;
  for (uint32_t ps : kPageSizes) {
    for (int32_t ptp : kTpSizes) {
      for (int32_t dtp : kTpSizes) {
        for (int32_t h : kHeadCounts) {
          writes += CheckConfig(KvConfig(ptp, dtp, h, ps, KVLayout::kNHD));
        }
      }
    }
  }
  CHECK(writes > 0);
}

TEST_CASE("tp grid HND: prefill TP x decode TP x kv heads x page size") {
  uint64_t writes = 0;
  for (uint32_t ps : kPageSizes) {
    for (int32_t ptp : kTpSizes) {
      for (int32_t dtp : kTpSizes) {
        for (int32_t h : kHeadCounts) {
          writes += CheckConfig(KvConfig(ptp, dtp, h, ps, KVLayout::kHND));
        }
      }
    }
  }
  CHECK(writes > 0);
}

TEST_CASE("tp grid MLA: prefill TP x decode TP x page size") {
  for (uint32_t ps : kPageSizes) {
    for (int32_t ptp : kTpSizes) {
      for (int32_t dtp : kTpSizes) {
        ModelConfig c = KvConfig(ptp, dtp, 1, ps, KVLayout::kNHD);
        c.mla = true;
        CheckConfig(c);
      }
    }
  }
}

TEST_CASE("tp grid odd sizes: TP 3 and 6, heads 3, 6 and 12, unsplittable heads refused") {
  auto splits = [](int32_t heads, int32_t tp) {
    return heads >= tp ? heads % tp == 0 : tp % heads == 0;
  };
  int32_t refused = 0;
  for (KVLayout layout : kLayouts) {
    for (int32_t ptp : {1, 2, 3, 6}) {
      for (int32_t dtp : {1, 2, 3, 6}) {
        for (int32_t h : {1, 2, 3, 6, 12}) {
          const ModelConfig c = KvConfig(ptp, dtp, h, 4, layout);
          if (splits(h, ptp) && splits(h, dtp)) {
            CheckConfig(c);
            continue;
          }
          ++refused;
          std::mt19937_64 rng(1);
          const RunResult res = RunModel(c, MakeRandomRequest(c, 3, rng));
          INFO(c.Describe());
          CHECK_FALSE(res.accepted);
          CHECK(res.failure.empty());
        }
      }
    }
  }
  CHECK(refused > 0);
}

}  // namespace
}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
