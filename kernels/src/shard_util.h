// What the CPU and the CUDA model share for a sharded forward pass (parallel.h): one rank's
// weights of one layer, sliced and regrouped; the column interleave after a TP gather; and the
// sampled results as bytes, which the last PP stage hands to the others. Pure host code.
#ifndef PDLIB_KERNELS_SRC_SHARD_UTIL_H_
#define PDLIB_KERNELS_SRC_SHARD_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "pdlib/status.h"
#include "pdlib_kernels/model.h"
#include "pdlib_kernels/parallel.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::kernels::internal {

// One rank's weights of one layer, regrouped for the forward pass: the projections that read
// the same input are stacked into one matrix (q|k|v, MLA q|kv_a, in|decay|gate, gate|up) so one
// parallel matmul computes them all. Stacking rows does not change any dot product, so results
// equal the separate matmuls. Sharded matrices hold only the rank's rows (ShardLayout).
struct RankLayer {
  LayerKind kind = LayerKind::kAttention;
  int32_t pool_index = -1;  // the stage's KV layer, SWA layer or state layer
  std::vector<float> input_norm;
  // [q; k; v] of the rank's heads, MLA [q of the rank's heads; kv_a], or [in; decay; gate]
  // (replicated), each [width][hidden].
  std::vector<float> mix_in;
  std::vector<float> mix_out;  // the rank's output rows of o_proj, or rec_out_proj (whole)
  // Full attention layers with a lightning indexer: [index_q_proj; index_k_proj], replicated
  // whole on every TP rank ([2 * index_dim][hidden]); empty otherwise.
  std::vector<float> index_proj;
  // MLA: the latent's RMSNorm weight and the rank's heads' rows of kv_b_proj.
  std::vector<float> kv_a_norm;
  std::vector<float> kv_b;
  std::vector<float> post_norm;
  std::vector<float> gate_up;  // [gate; up] of the rank's intermediate units
  std::vector<float> down;     // the rank's output rows of down_proj
};

// Model layer `layer` (inside the layout's stage) as the rank holds it.
RankLayer SliceLayer(const ModelWeights& w, const ShardLayout& layout, int32_t layer);

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts);
// Rows [begin, begin + count) of a row-major matrix with `width` columns.
std::vector<float> Rows(const std::vector<float>& m, int32_t width, int32_t begin, int32_t count);

// gathered is [parts][rows][width] (what AllGather of a [rows][width] slice returns); out is
// [rows][parts * width] with part p's columns at [p * width, (p + 1) * width).
void Interleave(const std::vector<float>& gathered, int32_t parts, int64_t rows, int32_t width,
                std::vector<float>* out);

// ForwardResults as bytes and back; Deserialize refuses malformed bytes with kInternal.
void SerializeResults(const std::vector<ForwardResult>& results, std::vector<std::byte>* out);
Status DeserializeResults(const std::vector<std::byte>& bytes, std::vector<ForwardResult>* out);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_SHARD_UTIL_H_
