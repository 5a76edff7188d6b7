// The CUDA model's factory, declared without CUDA types so model.cc (a C++ file) can call it.
// Builds without CUDA link cuda_stub.cc instead, whose factory reports kUnavailable.
#ifndef PDLIB_KERNELS_SRC_CUDA_CUDA_MODEL_H_
#define PDLIB_KERNELS_SRC_CUDA_CUDA_MODEL_H_

#include <memory>

#include "pdlib_kernels/model.h"

namespace pdlib::kernels::internal {

StatusOr<std::unique_ptr<Model>> CreateCudaModel(const ModelWeights& weights,
                                                 const RuntimeOptions& options);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CUDA_CUDA_MODEL_H_
