// The reference model's configurations and requests: descriptions, random requests with
// random chunkings and index runs, and state tensors for every state type.
#include <algorithm>
#include <numeric>
#include <sstream>

#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {

int32_t ModelConfig::total_layers() const {
  return std::accumulate(stage_layers.begin(), stage_layers.end(), 0);
}

std::string ModelConfig::Describe() const {
  std::ostringstream os;
  os << "TP " << prefill_tp << "->" << decode_tp << ", PP " << prefill_pp << "->" << decode_pp
     << ", " << (mla ? "MLA" : KVLayoutName(layout)) << ", kv heads " << kv_heads << ", head bytes "
     << (mla ? mla_bytes : head_bytes) << ", page " << page_size << ", stage layers [";
  for (int32_t l : stage_layers) os << " " << l;
  os << " ], state " << StateTypeName(state_type) << " [";
  for (const auto& s : state) {
    os << " (dim " << s.split_dim << " rows " << s.rows << " units " << s.split_units << " x "
       << s.unit_bytes << ")";
  }
  os << " ] stage states [";
  for (int32_t n : stage_states) os << " " << n;
  os << " ]";
  return os.str();
}

std::string Request::Describe() const {
  std::ostringstream os;
  os << num_tokens << " tokens in chunks [";
  for (int64_t t : chunk_tokens) os << " " << t;
  os << " ], prefill rank 0 pages [";
  if (!src_pages.empty()) {
    for (int32_t p : src_pages[0]) os << " " << p;
  }
  os << " ], decode rank 0 pages [";
  if (!dst_pages.empty()) {
    for (int32_t p : dst_pages[0]) os << " " << p;
  }
  os << " ]";
  return os.str();
}

namespace {

std::vector<int32_t> RandomIndices(int32_t pool, int32_t k, std::mt19937_64& rng) {
  std::vector<int32_t> all(static_cast<size_t>(pool));
  std::iota(all.begin(), all.end(), 0);
  switch (rng() % 3) {
    case 0: {  // scattered
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(static_cast<size_t>(k));
      return all;
    }
    case 1: {  // one consecutive run
      const int32_t start = static_cast<int32_t>(rng() % static_cast<uint64_t>(pool - k + 1));
      return std::vector<int32_t>(all.begin() + start, all.begin() + start + k);
    }
    default: {  // ascending with gaps: several runs
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(static_cast<size_t>(k));
      std::sort(all.begin(), all.end());
      return all;
    }
  }
}

}  // namespace

Request MakeRandomRequest(const ModelConfig& c, int32_t max_pages, std::mt19937_64& rng) {
  Request r;
  const int64_t ps = c.page_size;
  const int32_t pages = 1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(max_pages));
  r.num_tokens = (pages - 1) * ps + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(ps));
  int64_t start = 0;
  for (int32_t cut = 1; cut < pages; ++cut) {
    if (rng() % 5 < 2) {
      r.chunk_tokens.push_back(cut * ps - start);
      start = cut * ps;
    }
  }
  if (rng() % 8 == 0) r.chunk_tokens.insert(r.chunk_tokens.begin(), 0);  // an empty chunk
  r.chunk_tokens.push_back(r.num_tokens - start);
  int32_t states = 0;
  switch (c.state_type) {
    case StateType::kNone: states = 0; break;
    case StateType::kMamba: states = 1; break;
    case StateType::kSwa: states = std::min(pages, 2); break;
    case StateType::kNsa:
    case StateType::kMinimaxIndexK: states = pages; break;
    case StateType::kSwaRing:
      states = std::min({pages * static_cast<int32_t>(c.page_size), 3, c.state_pool});
      break;
    case StateType::kC128State: states = static_cast<int32_t>(rng() % 2); break;
  }
  for (auto [tp, pp, src] : {std::tuple{c.prefill_tp, c.prefill_pp, true},
                             std::tuple{c.decode_tp, c.decode_pp, false}}) {
    for (int32_t i = 0; i < tp * pp; ++i) {
      (src ? r.src_pages : r.dst_pages).push_back(RandomIndices(c.kv_pool_pages, pages, rng));
      (src ? r.src_aux : r.dst_aux).push_back(static_cast<int64_t>(rng() % c.aux_slots));
      (src ? r.src_state : r.dst_state).push_back(RandomIndices(c.state_pool, states, rng));
    }
  }
  return r;
}

void AddStateTensors(ModelConfig* c, StateType type) {
  c->state_type = type;
  c->state.clear();
  const uint64_t heads = static_cast<uint64_t>(c->mla ? 1 : c->kv_heads);
  switch (type) {
    case StateType::kNone: break;
    case StateType::kMamba:
      // conv state split by bytes of dim 0; temporal state split by 4 heads (replicated on TP 8);
      // a tensor split along dim 1 behind 2 rows; a replicated one.
      c->state = {{0, 1, 0, 16}, {0, 1, 4, 3}, {1, 2, 8, 2}, {-1, 1, 0, 5}};
      break;
    case StateType::kSwa:
      // A sliding-window KV pool: pages split by kv head, NHD-like (rows = tokens) and HND-like.
      c->state = {{1, c->page_size, heads, c->head_bytes},
                  {0, 1, heads, uint64_t{c->page_size} * c->head_bytes},
                  {-1, 1, 0, 7}};
      break;
    case StateType::kNsa:
    case StateType::kMinimaxIndexK:
      // The indexer keys (replicated) and one byte-split tensor.
      c->state = {{-1, 1, 0, 6}, {0, 1, 0, 8}};
      break;
    case StateType::kSwaRing:
      // Ring rows split by kv head, and a replicated row.
      c->state = {{0, 1, heads, c->head_bytes}, {-1, 1, 0, 4}};
      break;
    case StateType::kC128State:
      // A request-scoped slot, replicated.
      c->state = {{-1, 1, 0, 12}};
      break;
  }
  // Spread the tensors over the stages, the first stage taking the fewest.
  const int32_t n = static_cast<int32_t>(c->state.size());
  const int32_t pp = c->prefill_pp;
  c->stage_states.clear();
  for (int32_t s = 0; s < pp; ++s) c->stage_states.push_back(n * (s + 1) / pp - n * s / pp);
  c->state_pool = std::max(c->state_pool, c->kv_pool_pages);
}

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
