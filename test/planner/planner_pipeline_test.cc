// Pipeline parallelism (SPEC R5.6): stage layer ranges, decode PP 1 receiving from every stage,
// equal PP pairing stage to stage, and the grid over PP x TP x heads x page size x layout.
#include <catch2/catch.hpp>

#include "lib/planner/planner.h"
#include "test/planner/grid.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

TEST_CASE("pipeline: decode PP 1 maps each stage's layers onto its own buffers") {
  // Three layers: prefill stage 0 holds layer 0, stage 1 layers 1 and 2.
  ModelConfig c = KvConfig(1, 1, 2, 4, KVLayout::kHND, 2, 1);
  auto plan = MakePairPlan(MakeLayout(c, true, 0, 1), MakeLayout(c, false, 0, 0));
  REQUIRE(plan.ok());
  REQUIRE(plan->kv.size() == 4);
  // Layer-major: (layer 1 K, layer 1 V, layer 2 K, layer 2 V); decode buffers are K0 K1 K2 V0..
  CHECK(plan->kv[0].src_buffer == 0);
  CHECK(plan->kv[0].dst_buffer == 1);
  CHECK(plan->kv[1].src_buffer == 2);
  CHECK(plan->kv[1].dst_buffer == 4);
  CHECK(plan->kv[3].src_buffer == 3);
  CHECK(plan->kv[3].dst_buffer == 5);
  CHECK(plan->writes_aux);  // the last stage carries aux
  auto first = MakePairPlan(MakeLayout(c, true, 0, 0), MakeLayout(c, false, 0, 0));
  REQUIRE(first.ok());
  CHECK_FALSE(first->writes_aux);

  const Topology t{2, 2, 2, 1, {2}};
  CHECK(*ExpectedPrefillRanks(t, {1, 0}) == std::vector<RankId>{{1, 0}, {1, 1}});
  CHECK(*TargetsForPrefillRank(t, {0, 1}) == std::vector<RankId>{{0, 0}});
  CHECK(*AuxWriter(t, {0, 0}) == RankId{0, 1});
}

TEST_CASE("pipeline: equal PP pairs stage with stage and refuses anything else") {
  ModelConfig c = KvConfig(2, 2, 4, 16, KVLayout::kNHD, 2, 2);
  auto same = MakePairPlan(MakeLayout(c, true, 0, 1), MakeLayout(c, false, 0, 1));
  REQUIRE(same.ok());
  CHECK(same->writes_aux);
  auto cross = MakePairPlan(MakeLayout(c, true, 0, 0), MakeLayout(c, false, 0, 1));
  CHECK(cross.status().code() == StatusCode::kInvalidArgument);
  const Topology t{2, 2, 2, 2, {4}};
  CHECK(*ExpectedPrefillRanks(t, {0, 1}) == std::vector<RankId>{{0, 1}});
  CHECK(*AuxWriter(t, {0, 0}) == RankId{0, 0});

  // Prefill PP 2 -> decode PP 4, and PP 1 -> PP 2: neither equal nor 1.
  const Topology bad{2, 2, 2, 4, {4}};
  Status s = ValidateTopology(bad);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find("pipeline mismatch: prefill PP 2, decode PP 4") != std::string::npos);
  ModelConfig up = KvConfig(1, 1, 4, 16, KVLayout::kNHD, 1, 2);
  auto refused = MakePairPlan(MakeLayout(up, true, 0, 0), MakeLayout(up, false, 0, 0));
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);

  // A decode stage whose layers differ from the prefill stage's.
  ModelConfig other = c;
  other.stage_layers = {2, 1};
  auto shifted = MakePairPlan(MakeLayout(c, true, 0, 1), MakeLayout(other, false, 0, 1));
  CHECK(shifted.status().code() == StatusCode::kFailedPrecondition);
}

void PipelineGrid(int32_t decode_pp, KVLayout layout) {
  for (uint32_t ps : kPageSizes) {
    for (int32_t ptp : kTpSizes) {
      for (int32_t dtp : kTpSizes) {
        for (int32_t h : kHeadCounts) {
          ModelConfig c = KvConfig(ptp, dtp, h, ps, layout, 2, decode_pp);
          CheckConfig(c, 2);
          AddStateTensors(&c, StateType::kMamba);
          CheckConfig(c, 2);
        }
      }
    }
  }
}

TEST_CASE("pipeline grid PP 2 -> 1 NHD") { PipelineGrid(1, KVLayout::kNHD); }
TEST_CASE("pipeline grid PP 2 -> 1 HND") { PipelineGrid(1, KVLayout::kHND); }
TEST_CASE("pipeline grid PP 2 -> 2 NHD") { PipelineGrid(2, KVLayout::kNHD); }
TEST_CASE("pipeline grid PP 2 -> 2 HND") { PipelineGrid(2, KVLayout::kHND); }

TEST_CASE("pipeline grid MLA PP 2 -> 1 and 2 -> 2") {
  for (int32_t decode_pp : {1, 2}) {
    for (int32_t ptp : kTpSizes) {
      for (int32_t dtp : kTpSizes) {
        ModelConfig c = KvConfig(ptp, dtp, 1, 16, KVLayout::kNHD, 2, decode_pp);
        c.mla = true;
        AddStateTensors(&c, StateType::kNsa);
        CheckConfig(c);
      }
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
