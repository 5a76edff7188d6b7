// The CPU reference model: host KV cache, fp32 weights, ops from cpu/ops.h on a thread pool.
#ifndef PDLIB_KERNELS_SRC_CPU_CPU_MODEL_H_
#define PDLIB_KERNELS_SRC_CPU_CPU_MODEL_H_

#include <memory>

#include "pdlib_kernels/model.h"

namespace pdlib::kernels::internal {

StatusOr<std::unique_ptr<Model>> CreateCpuModel(const ModelWeights& weights,
                                                const RuntimeOptions& options);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CPU_CPU_MODEL_H_
