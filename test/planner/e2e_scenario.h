// End-to-end planner scenarios (planner_e2e_test, pdlib_planner_peer): a model shape, both
// sides' parallel layouts, and the byte pattern that makes every KV and state byte a function of
// its place in the MODEL (room, global layer, K or V, token position, global head, byte), not of
// the rank that holds it. Prefill ranks fill their pools with it; decode ranks check that every
// byte of every page and state slot they own holds the value for their own global coordinates.
// A head slice written to the wrong head, token, page, layer or rank shows up as a wrong byte.
//
// Header-only so the peer binary and the test agree without a library.
#ifndef PDLIB_TEST_PLANNER_E2E_SCENARIO_H_
#define PDLIB_TEST_PLANNER_E2E_SCENARIO_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/kv_args.h"

namespace pdlib_e2e {

struct SideShape {
  int32_t tp = 1;
  int32_t pp = 1;
};

struct Scenario {
  std::string name;
  SideShape prefill, decode;
  int32_t layers = 4;
  int32_t heads = 8;  // KV heads of the model (MLA: ignored, one latent)
  uint32_t head_bytes = 32;
  uint32_t page_size = 4;
  pdlib::KVLayout layout = pdlib::KVLayout::kHND;
  bool mla = false;
  // Mamba-style state: `state_split` buffers split on dimension 0 into `state_units` units of
  // `state_unit_bytes`, plus `state_replicated` buffers every TP rank holds whole.
  int32_t state_split = 0;
  int32_t state_replicated = 0;
  uint32_t state_units = 8;
  uint32_t state_unit_bytes = 16;
  // More state families after the mamba one (issue #27): 1 adds a swa family (the window's last
  // kWindowPages pages in a paged pool), 2 also a c128_state family (one slot on odd rooms, none
  // on even ones). Each has one replicated buffer per model layer, split over PP stages like
  // the layers.
  int32_t extra_families = 0;
  int32_t pages_per_request = 5;
  int32_t chunks = 2;  // KV chunks per request (the last may be shorter)
  int32_t rooms = 6;
  int32_t pool_pages = 64;
};

inline std::vector<Scenario> AllScenarios() {
  std::vector<Scenario> v;
  auto add = [&](Scenario s) { v.push_back(std::move(s)); };
  add({.name = "tp_2p1d_hnd", .prefill = {2, 1}, .decode = {1, 1}});
  add({.name = "tp_2p1d_nhd",
       .prefill = {2, 1},
       .decode = {1, 1},
       .layout = pdlib::KVLayout::kNHD});
  add({.name = "tp_1p2d_nhd",
       .prefill = {1, 1},
       .decode = {2, 1},
       .layout = pdlib::KVLayout::kNHD});
  // GQA: 2 KV heads over prefill TP 4 (each head on 2 ranks) into decode TP 2.
  add({.name = "tp_4p2d_gqa", .prefill = {4, 1}, .decode = {2, 1}, .heads = 2});
  add({.name = "mla_2p2d", .prefill = {2, 1}, .decode = {2, 1}, .mla = true});
  // MLA 4 -> 2: prefill ranks 1 and 3 write nothing and get dummy TransferInfos.
  add({.name = "mla_4p2d", .prefill = {4, 1}, .decode = {2, 1}, .mla = true});
  add({.name = "pipeline_pp2", .prefill = {1, 2}, .decode = {1, 1}, .state_split = 2});
  add({.name = "state_mamba_2p1d",
       .prefill = {2, 1},
       .decode = {1, 1},
       .state_split = 2,
       .state_replicated = 1});
  // Several state families at once (mamba + swa + c128_state), TP both ways and PP.
  add({.name = "families_2p1d",
       .prefill = {2, 1},
       .decode = {1, 1},
       .state_split = 1,
       .state_replicated = 1,
       .extra_families = 2});
  add({.name = "families_1p2d",
       .prefill = {1, 1},
       .decode = {2, 1},
       .state_split = 1,
       .state_replicated = 1,
       .extra_families = 2});
  add({.name = "families_pp2",
       .prefill = {1, 2},
       .decode = {1, 1},
       .state_split = 2,
       .extra_families = 1});
  return v;
}

inline std::optional<Scenario> FindScenario(std::string_view name) {
  for (auto& s : AllScenarios()) {
    if (s.name == name) return s;
  }
  return std::nullopt;
}

// What one rank holds.
struct RankShape {
  int32_t tp_rank = 0, tp_size = 1, pp_rank = 0, pp_size = 1;
  int32_t start_layer = 0, num_layers = 0;
  int32_t first_head = 0, num_heads = 1;  // global heads held (MLA: the latent, "head" 0)
  int32_t state_start = 0, num_states = 0;
};

inline int32_t StatesTotal(const Scenario& s) { return s.state_split + s.state_replicated; }

inline RankShape ShapeOf(const Scenario& s, const SideShape& side, int32_t tp_rank,
                         int32_t pp_rank) {
  RankShape r;
  r.tp_rank = tp_rank;
  r.tp_size = side.tp;
  r.pp_rank = pp_rank;
  r.pp_size = side.pp;
  r.num_layers = s.layers / side.pp;
  r.start_layer = pp_rank * r.num_layers;
  if (s.mla) {
    r.first_head = 0;
    r.num_heads = 1;
  } else if (s.heads >= side.tp) {
    r.num_heads = s.heads / side.tp;
    r.first_head = tp_rank * r.num_heads;
  } else {
    r.num_heads = 1;
    r.first_head = tp_rank / (side.tp / s.heads);
  }
  // State buffers: split ones first, then replicated; PP stages split them evenly.
  const int32_t total = StatesTotal(s);
  r.num_states = total / side.pp;
  r.state_start = pp_rank * r.num_states;
  return r;
}

inline bool StateIsSplit(const Scenario& s, int32_t global_state) {
  return global_state < s.state_split;
}

inline uint64_t KvItemBytes(const Scenario& s, const RankShape& r) {
  return uint64_t{s.page_size} * s.head_bytes * static_cast<uint64_t>(r.num_heads);
}

inline uint64_t StateItemBytes(const Scenario& s, const RankShape& r, int32_t global_state) {
  if (!StateIsSplit(s, global_state)) return uint64_t{s.state_units} * s.state_unit_bytes;
  return uint64_t{s.state_units} / static_cast<uint64_t>(r.tp_size) * s.state_unit_bytes;
}

// The byte the model has at one coordinate. Cheap and well mixed.
inline uint8_t PatternByte(uint64_t room, uint64_t a, uint64_t b, uint64_t c, uint64_t d,
                           uint64_t e) {
  uint64_t x = room * 0x9E3779B97F4A7C15ull ^ (a + 1) * 0xC2B2AE3D27D4EB4Full ^
               (b + 3) * 0x165667B19E3779F9ull ^ (c + 7) * 0xD6E8FEB86659FD93ull ^
               (d + 11) * 0xFF51AFD7ED558CCDull ^ (e + 13) * 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

// The byte at `offset` inside one KV page of a rank, for the request's page `page_in_request`.
inline uint8_t KvByte(const Scenario& s, const RankShape& r, uint64_t room, int32_t global_layer,
                      int kv, int64_t page_in_request, uint64_t offset) {
  const uint64_t hb = s.head_bytes;
  const uint64_t byte = offset % hb;
  uint64_t token, local_head;
  if (s.mla || s.layout == pdlib::KVLayout::kNHD) {  // [token][head][byte]
    token = offset / hb / static_cast<uint64_t>(r.num_heads);
    local_head = offset / hb % static_cast<uint64_t>(r.num_heads);
  } else {  // [head][token][byte]
    local_head = offset / hb / s.page_size;
    token = offset / hb % s.page_size;
  }
  const uint64_t position = static_cast<uint64_t>(page_in_request) * s.page_size + token;
  return PatternByte(room, static_cast<uint64_t>(global_layer), static_cast<uint64_t>(kv), position,
                     static_cast<uint64_t>(r.first_head) + local_head, byte);
}

inline uint8_t StateByte(const Scenario& s, const RankShape& r, uint64_t room, int32_t global_state,
                         uint64_t offset) {
  uint64_t unit = offset / s.state_unit_bytes;
  if (StateIsSplit(s, global_state)) {
    unit += static_cast<uint64_t>(r.tp_rank) * (s.state_units / static_cast<uint64_t>(r.tp_size));
  }
  return PatternByte(room, 1000 + static_cast<uint64_t>(global_state), 0, 0, unit,
                     offset % s.state_unit_bytes);
}

// Pool page indices of a request: distinct, scattered, the same on every rank of one side.
inline std::vector<int32_t> RequestPages(const Scenario& s, uint64_t room, bool decode_side) {
  std::vector<int32_t> all(static_cast<size_t>(s.pool_pages));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(room * 2 + (decode_side ? 1 : 0));
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(s.pages_per_request));
  return all;
}

// State slot of a request (one per request, mamba-style).
inline int32_t RequestStateSlot(const Scenario& s, uint64_t room, bool decode_side) {
  return static_cast<int32_t>((room * 7 + (decode_side ? 3 : 0)) % static_cast<uint64_t>(s.rooms));
}

// Decode prefix reuse (--decode-prefix): the pages at the start of the request decode already
// holds, cycling through none, one, all but the last and all of them.
inline int32_t PrefixPages(const Scenario& s, uint64_t room) {
  const int32_t n = s.pages_per_request;
  const int32_t choices[] = {0, 1, n - 1, n};
  return choices[room % 4];
}

// The extra state families (Scenario::extra_families).
constexpr int32_t kWindowPages = 2;
constexpr uint64_t kExtraItemBytes = 24;
inline pdlib::StateType ExtraFamilyType(int32_t k) {
  return k == 0 ? pdlib::StateType::kSwa : pdlib::StateType::kC128State;
}
inline uint64_t ExtraFamilyItems(const Scenario& s, int32_t k) {
  return static_cast<uint64_t>(k == 0 ? s.pool_pages : s.rooms);
}
// Entry `entry` of the request's list for extra family k, model layer `layer`.
inline uint8_t ExtraByte(uint64_t room, int32_t k, int32_t layer, size_t entry, uint64_t offset) {
  return PatternByte(room, 2000 + 100 * static_cast<uint64_t>(k) + static_cast<uint64_t>(layer),
                     entry, 0, 0, offset);
}
// The request's index list of extra family k on one side.
inline std::vector<int32_t> ExtraIndices(const Scenario& s, uint64_t room, int32_t k,
                                         bool decode_side) {
  if (k == 0) {
    std::vector<int32_t> pages = RequestPages(s, room, decode_side);
    const size_t w = std::min<size_t>(kWindowPages, pages.size());
    return {pages.end() - static_cast<std::ptrdiff_t>(w), pages.end()};
  }
  if (room % 2 == 0) return {};
  return {RequestStateSlot(s, room, decode_side)};
}

}  // namespace pdlib_e2e

#endif  // PDLIB_TEST_PLANNER_E2E_SCENARIO_H_
