// A KV-only SideLayout for tests and benchmarks of what the planner's writes become (the
// cuda_ipc copy plan, the re-layout bench): K and V buffers of every local layer, no aux or state.
#ifndef PDLIB_LIB_PLANNER_KV_LAYOUT_TESTING_H_
#define PDLIB_LIB_PLANNER_KV_LAYOUT_TESTING_H_

#include <cstdint>

#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace planner {

struct KvShape {
  int32_t layers = 1;
  int32_t total_heads = 1;  // the model's KV heads, split over the TP ranks
  uint32_t page_size = 1;   // tokens per page
  uint64_t head_bytes = 1;  // one head of one token
  int32_t pool_pages = 1;   // items in every buffer
};

// TP rank `tp_rank` of `tp_size` (PP 1) holding total_heads / tp_size heads in `layout`.
inline SideLayout KvOnlySideLayout(const KvShape& shape, int32_t tp_size, int32_t tp_rank,
                                   KVLayout layout) {
  SideLayout l;
  l.tp_size = tp_size;
  l.tp_rank = tp_rank;
  l.total_layers = shape.layers;
  l.total_kv_heads = shape.total_heads;
  l.kv_heads = shape.total_heads / tp_size;
  l.page_size = shape.page_size;
  l.layout = layout;
  const uint64_t item = shape.page_size * static_cast<uint64_t>(l.kv_heads) * shape.head_bytes;
  for (int32_t b = 0; b < 2 * shape.layers; ++b) {
    l.kv.push_back({item, item * static_cast<uint64_t>(shape.pool_pages)});
  }
  return l;
}

}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_PLANNER_KV_LAYOUT_TESTING_H_
