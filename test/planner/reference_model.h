// A reference model of a whole deployment for the planner's tests and fuzzer: simulated byte
// arrays for every prefill and decode rank, prefill filled with a pattern that encodes
// (layer, K/V, token, head, byte) (state: buffer, index position, row, unit, byte), the planned
// writes applied to decode, and decode compared with a naive per-token, per-head expected image
// built from the engines' own conventions (not from the planner's arithmetic).
//
// Checked on every run: no write leaves its region; consecutive writes could not have been
// merged; the pairing decisions agree with the per-pair plans (targets, expected ranks, dummies,
// aux writer). When every pair and chunk is accepted: every expected decode byte is written
// exactly once with the right value and no other byte is touched (so no two writes overlap).
#ifndef PDLIB_TEST_PLANNER_REFERENCE_MODEL_H_
#define PDLIB_TEST_PLANNER_REFERENCE_MODEL_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {

// One model-wide state tensor.
struct StateTensorSpec {
  int32_t split_dim = -1;    // -1: replicated on every TP rank
  uint64_t rows = 1;         // rows before the split dimension
  uint64_t split_units = 0;  // 0: split by bytes
  // Replicated: item bytes. Split by units: bytes per unit per row. Split by bytes: the full
  // row's bytes across all TP ranks.
  uint64_t unit_bytes = 4;
};

struct ModelConfig {
  int32_t prefill_tp = 1;
  int32_t decode_tp = 1;
  int32_t prefill_pp = 1;
  int32_t decode_pp = 1;
  int32_t kv_heads = 1;  // model total (non-MLA)
  uint32_t head_bytes = 2;
  uint32_t mla_bytes = 3;  // MLA latent bytes per token
  uint32_t page_size = 1;
  KVLayout layout = KVLayout::kNHD;
  bool mla = false;
  std::vector<int32_t> stage_layers = {2};  // prefill layers per stage
  std::vector<uint32_t> aux_item_bytes = {8, 4};
  StateType state_type = StateType::kNone;
  std::vector<StateTensorSpec> state;       // model-wide
  std::vector<int32_t> stage_states = {0};  // state tensors per prefill stage
  int32_t kv_pool_pages = 6;
  int32_t state_pool = 6;
  int32_t aux_slots = 3;

  int32_t total_layers() const;
  std::string Describe() const;
};

// One request: its chunking and the indices every rank uses. Rank r of a side is
// tp_rank + pp_rank * tp_size.
struct Request {
  int64_t num_tokens = 0;
  std::vector<int64_t> chunk_tokens;  // tokens per chunk, in order; the last entry is last
  std::vector<std::vector<int32_t>> src_pages, dst_pages;
  std::vector<int64_t> src_aux, dst_aux;
  std::vector<std::vector<int32_t>> src_state, dst_state;
  std::string Describe() const;
};

// The layout of one rank as the engine would register it.
SideLayout MakeLayout(const ModelConfig& c, bool prefill, int32_t tp_rank, int32_t pp_rank);

// A valid random request for `c`: 1..max_pages pages, random chunking on page boundaries, index
// lists with some consecutive runs, state indices as the state type wants them.
Request MakeRandomRequest(const ModelConfig& c, int32_t max_pages, std::mt19937_64& rng);

// Fills configs with state tensors that exercise every kind of split for `type`.
void AddStateTensors(ModelConfig* c, StateType type);

struct RunResult {
  bool accepted = false;  // every pair and every chunk was planned
  Status first_error;     // why not, when !accepted
  std::string failure;    // a violated property; empty when none
  uint64_t writes = 0;
  uint64_t bytes = 0;
  int32_t active_pairs = 0;
  int32_t dummies = 0;
};

// Plans and applies `r` on `c` and checks every property (file comment).
RunResult RunModel(const ModelConfig& c, const Request& r);

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_TEST_PLANNER_REFERENCE_MODEL_H_
