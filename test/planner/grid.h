// Helpers for the planner's exhaustive grids: small model configurations and a check that runs
// random requests through the reference model.
#ifndef PDLIB_TEST_PLANNER_GRID_H_
#define PDLIB_TEST_PLANNER_GRID_H_

#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <vector>

#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {

inline const std::vector<int32_t> kTpSizes = {1, 2, 4, 8};
inline const std::vector<int32_t> kHeadCounts = {1, 2, 4, 8};
inline const std::vector<uint32_t> kPageSizes = {1, 16, 64};
inline const std::vector<KVLayout> kLayouts = {KVLayout::kNHD, KVLayout::kHND};

// A small model: 2 layers per PP 1 side (PP 2: stages of 1 and 2 layers), head bytes 2-4.
inline ModelConfig KvConfig(int32_t prefill_tp, int32_t decode_tp, int32_t heads,
                            uint32_t page_size, KVLayout layout, int32_t prefill_pp = 1,
                            int32_t decode_pp = 1) {
  ModelConfig c;
  c.prefill_tp = prefill_tp;
  c.decode_tp = decode_tp;
  c.prefill_pp = prefill_pp;
  c.decode_pp = decode_pp;
  c.kv_heads = heads;
  c.head_bytes = 2 + static_cast<uint32_t>(prefill_tp + decode_tp + heads) % 3;
  c.page_size = page_size;
  c.layout = layout;
  c.stage_layers = prefill_pp == 1 ? std::vector<int32_t>{2} : std::vector<int32_t>{1, 2};
  c.stage_states.assign(static_cast<size_t>(prefill_pp), 0);
  return c;
}

inline uint64_t SeedOf(const ModelConfig& c) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : c.Describe()) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  return h;
}

// Runs `requests` random requests (random chunkings, index runs) through the reference model
// and requires every property. Returns the number of writes planned.
inline uint64_t CheckConfig(const ModelConfig& c, int requests = 3, int32_t max_pages = 5) {
  std::mt19937_64 rng(SeedOf(c));
  uint64_t writes = 0;
  for (int i = 0; i < requests; ++i) {
    const Request r = MakeRandomRequest(c, max_pages, rng);
    const RunResult res = RunModel(c, r);
    if (!res.accepted || !res.failure.empty()) {
      INFO(c.Describe());
      INFO(r.Describe());
      INFO(res.first_error.ToString());
      INFO(res.failure);
      REQUIRE(res.accepted);
      REQUIRE(res.failure.empty());
    }
    writes += res.writes;
  }
  return writes;
}

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_TEST_PLANNER_GRID_H_
