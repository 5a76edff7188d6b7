// DeviceKVCache: a KVCache whose pools are zero-filled cudaMalloc allocations on one device,
// one per pool (so each can be registered with pdlib as MemoryKind::kCuda).
#ifndef PDLIB_KERNELS_SRC_CUDA_CUDA_KV_CACHE_CUH_
#define PDLIB_KERNELS_SRC_CUDA_CUDA_KV_CACHE_CUH_

#include <memory>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "pdlib_kernels/kv_cache.h"

namespace pdlib::kernels::internal {

class DeviceKVCache final : public KVCache {
 public:
  static StatusOr<std::unique_ptr<DeviceKVCache>> Create(const ModelConfig& config,
                                                         int32_t num_pages, int32_t num_state_slots,
                                                         int device);

 private:
  DeviceKVCache(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots, int device)
      : KVCache(config, num_pages, num_state_slots, MemoryKind::kCuda), device_(device) {}

  Status CopyToHost(const void* src, void* dst, size_t bytes) const override;
  Status CopyFromHost(const void* src, void* dst, size_t bytes) override;
  StatusOr<PoolRegion> Allocate(size_t bytes, size_t item_bytes);

  int device_;
  std::vector<DeviceBuffer> allocations_;
};

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CUDA_CUDA_KV_CACHE_CUH_
