#include "cuda/cuda_kv_cache.cuh"

namespace pdlib::kernels::internal {

StatusOr<std::unique_ptr<DeviceKVCache>> DeviceKVCache::Create(const ModelConfig& config,
                                                               int32_t num_pages,
                                                               int32_t num_state_slots,
                                                               int device) {
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  std::unique_ptr<DeviceKVCache> cache(
      new DeviceKVCache(config, num_pages, num_state_slots, device));
  const size_t page_bytes = config.kv_page_bytes();
  for (int32_t l = 0; l < config.num_attention_layers(); ++l) {
    for (std::vector<PoolRegion>* pools : {&cache->k_pools_, &cache->v_pools_}) {
      StatusOr<PoolRegion> r =
          cache->Allocate(page_bytes * static_cast<size_t>(num_pages), page_bytes);
      if (!r.ok()) return r.status();
      pools->push_back(*r);
    }
  }
  const size_t slot_bytes = config.state_slot_bytes();
  for (int32_t l = 0; l < config.num_recurrent_layers(); ++l) {
    StatusOr<PoolRegion> r =
        cache->Allocate(slot_bytes * static_cast<size_t>(num_state_slots), slot_bytes);
    if (!r.ok()) return r.status();
    cache->state_pools_.push_back(*r);
  }
  // Spelled out: nvcc does not apply the implicit move into the converting constructor.
  return StatusOr<std::unique_ptr<DeviceKVCache>>(std::move(cache));
}

StatusOr<PoolRegion> DeviceKVCache::Allocate(size_t bytes, size_t item_bytes) {
  DeviceBuffer buffer;
  Status s = buffer.Grow(bytes);
  if (!s.ok()) return s.WithPrefix("KV cache");
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemset(buffer.get(), 0, bytes));
  PoolRegion region{buffer.get(), bytes, item_bytes};
  allocations_.push_back(std::move(buffer));
  return region;
}

Status DeviceKVCache::CopyToHost(const void* src, void* dst, size_t bytes) const {
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return Status::OK();
}

Status DeviceKVCache::CopyFromHost(const void* src, void* dst, size_t bytes) {
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return Status::OK();
}

}  // namespace pdlib::kernels::internal
