// Built instead of the .cu files when CMake found no CUDA compiler: every CUDA entry point
// exists and says why it cannot run.
#include "cuda/cuda_model.h"
#include "pdlib_kernels/cuda_info.h"

namespace pdlib::kernels {
namespace internal {

StatusOr<std::unique_ptr<Model>> CreateCudaModel(const ModelWeights&, const RuntimeOptions&) {
  return Status::Unavailable(
      "CUDA model requested but pdlib_kernels was built without CUDA (PDLIB_WITH_CUDA=OFF or no "
      "nvcc at configure time)");
}

}  // namespace internal

CudaInfo ProbeCuda() {
  CudaInfo info;
  info.reason =
      "pdlib_kernels was built without CUDA (PDLIB_WITH_CUDA=OFF or no nvcc at configure time)";
  return info;
}

StatusOr<DecodeAttentionBandwidth> MeasureCudaDecodeAttention(const ModelConfig&, int32_t, int32_t,
                                                              int32_t) {
  return Status::Unavailable("pdlib_kernels was built without CUDA");
}

}  // namespace pdlib::kernels
