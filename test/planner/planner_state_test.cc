// Hybrid-model state (SPEC R5.8): index rules per state type, TP-split and replicated state
// tensors, and the grid over every state type x PP x TP x heads x page size x layout.
#include <catch2/catch.hpp>

#include "lib/planner/planner.h"
#include "test/planner/grid.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

PairPlan StatePlan(StateType type, int32_t ptp, int32_t dtp, int32_t prank, int32_t drank) {
  ModelConfig c = KvConfig(ptp, dtp, 4, 4, KVLayout::kNHD);
  AddStateTensors(&c, type);
  auto plan = MakePairPlan(MakeLayout(c, true, prank, 0), MakeLayout(c, false, drank, 0));
  REQUIRE(plan.ok());
  return *plan;
}

TEST_CASE("state indices follow the state type") {
  PlanOutput out;
  const std::vector<int32_t> one = {1}, two = {1, 2}, three = {1, 2, 3}, none;
  TailInput tail;
  tail.request_pages = 2;

  const PairPlan mamba = StatePlan(StateType::kMamba, 1, 1, 0, 0);
  tail.src_state = one;
  tail.dst_state = one;
  CHECK(PlanTailWrites(mamba, tail, &out).ok());
  tail.src_state = two;
  tail.dst_state = two;
  CHECK(PlanTailWrites(mamba, tail, &out).code() == StatusCode::kInvalidArgument);
  CHECK(out.writes.empty());

  const PairPlan nsa = StatePlan(StateType::kNsa, 1, 1, 0, 0);
  CHECK(PlanTailWrites(nsa, tail, &out).ok());  // two pages, two indices
  tail.src_state = three;
  tail.dst_state = three;
  CHECK(PlanTailWrites(nsa, tail, &out).code() == StatusCode::kInvalidArgument);

  const PairPlan swa = StatePlan(StateType::kSwa, 1, 1, 0, 0);
  CHECK(PlanTailWrites(swa, tail, &out).code() == StatusCode::kInvalidArgument);  // > request
  tail.src_state = one;
  tail.dst_state = one;
  out.writes.clear();
  CHECK(PlanTailWrites(swa, tail, &out).ok());
  CHECK(out.writes.size() > 0);

  const PairPlan plain = StatePlan(StateType::kNone, 1, 1, 0, 0);
  Status s = PlanTailWrites(plain, tail, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("no state") != std::string::npos);

  tail.dst_state = two;
  CHECK(PlanTailWrites(mamba, tail, &out).code() == StatusCode::kInvalidArgument);  // 1 vs 2
  tail.src_state = {};
  tail.dst_state = {};
  out.writes.clear();
  CHECK(PlanTailWrites(mamba, tail, &out).ok());  // no state this time: nothing to write
  CHECK(out.writes.empty());
}

TEST_CASE("state: split tensors are sliced per TP pair, replicated ones written once") {
  // Mamba tensors (AddStateTensors): 16 bytes split by bytes; 4 heads x 3 bytes; 2 rows x 8
  // units x 2 bytes split along dim 1; 5 replicated bytes. Prefill TP 2 -> decode TP 1.
  const PairPlan p0 = StatePlan(StateType::kMamba, 2, 1, 0, 0);
  const PairPlan p1 = StatePlan(StateType::kMamba, 2, 1, 1, 0);
  REQUIRE(p0.state.size() == 4);  // the primary sender also writes the replicated tensor
  REQUIRE(p1.state.size() == 3);
  // Byte-split conv state: prefill rank 1 writes its 8 bytes at offset 8 of the 16-byte item.
  CHECK(p1.state[0].slice.dst_offset == 8);
  CHECK(p1.state[0].slice.piece_bytes == 8);
  CHECK(p1.state[0].slice.pieces == 1);
  // Split along dim 1 behind 2 rows: 2 pieces of 4 units x 2 bytes, 16 bytes apart on decode.
  CHECK(p1.state[2].slice.pieces == 2);
  CHECK(p1.state[2].slice.piece_bytes == 8);
  CHECK(p1.state[2].slice.dst_offset == 8);
  CHECK(p1.state[2].slice.dst_stride == 16);
  CHECK(p0.state[3].slice.whole_item);

  PlanOutput out;
  const std::vector<int32_t> src = {2}, dst = {5};
  TailInput tail;
  tail.src_state = src;
  tail.dst_state = dst;
  REQUIRE(PlanTailWrites(p1, tail, &out).ok());
  CHECK(out.writes.size() == 1 + 1 + 2);
  CHECK(out.writes[0].local_offset == 2 * 8);
  CHECK(out.writes[0].remote_offset == 5 * 16 + 8);
}

TEST_CASE("state: mismatched state shapes are refused at pairing") {
  ModelConfig c = KvConfig(1, 1, 4, 4, KVLayout::kNHD);
  AddStateTensors(&c, StateType::kMamba);
  SideLayout p = MakeLayout(c, true, 0, 0);
  SideLayout d = MakeLayout(c, false, 0, 0);
  d.state[3].item_bytes = 6;
  d.state[3].buffer_bytes = 6 * 8;
  CHECK(MakePairPlan(p, d).status().code() == StatusCode::kFailedPrecondition);
  d = MakeLayout(c, false, 0, 0);
  d.state[1].split_dim = -1;
  CHECK(MakePairPlan(p, d).status().code() == StatusCode::kFailedPrecondition);
  d = MakeLayout(c, false, 0, 0);
  d.state_type = StateType::kSwa;
  CHECK(MakePairPlan(p, d).status().code() == StatusCode::kFailedPrecondition);
  p.state[0].rows = 3;  // rows before dim 0 must be 1
  CHECK(ValidateSideLayout(p, "prefill").code() == StatusCode::kInvalidArgument);
}

void StateGrid(StateType type, const std::vector<std::pair<int32_t, int32_t>>& pps) {
  for (auto [ppp, dpp] : pps) {
    for (KVLayout layout : kLayouts) {
      for (uint32_t ps : kPageSizes) {
        for (int32_t ptp : kTpSizes) {
          for (int32_t dtp : kTpSizes) {
            for (int32_t h : kHeadCounts) {
              ModelConfig c = KvConfig(ptp, dtp, h, ps, layout, ppp, dpp);
              AddStateTensors(&c, type);
              CheckConfig(c, 2);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("state grid mamba PP 1") { StateGrid(StateType::kMamba, {{1, 1}}); }
TEST_CASE("state grid mamba PP 2") { StateGrid(StateType::kMamba, {{2, 1}, {2, 2}}); }
TEST_CASE("state grid swa PP 1") { StateGrid(StateType::kSwa, {{1, 1}}); }
TEST_CASE("state grid swa PP 2") { StateGrid(StateType::kSwa, {{2, 1}, {2, 2}}); }
TEST_CASE("state grid nsa PP 1") { StateGrid(StateType::kNsa, {{1, 1}}); }
TEST_CASE("state grid nsa PP 2") { StateGrid(StateType::kNsa, {{2, 1}, {2, 2}}); }
TEST_CASE("state grid minimax_index_k PP 1") { StateGrid(StateType::kMinimaxIndexK, {{1, 1}}); }
TEST_CASE("state grid swa_ring PP 1 and 2") {
  StateGrid(StateType::kSwaRing, {{1, 1}, {2, 1}, {2, 2}});
}
TEST_CASE("state grid c128_state PP 1 and 2") {
  StateGrid(StateType::kC128State, {{1, 1}, {2, 1}, {2, 2}});
}

}  // namespace
}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
