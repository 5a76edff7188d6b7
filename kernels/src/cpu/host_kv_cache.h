// HostKVCache: a KVCache whose pools are page-aligned, zero-filled host allocations, one per
// pool (so each can be registered with pdlib on its own).
#ifndef PDLIB_KERNELS_SRC_CPU_HOST_KV_CACHE_H_
#define PDLIB_KERNELS_SRC_CPU_HOST_KV_CACHE_H_

#include <cstdlib>
#include <memory>
#include <vector>

#include "pdlib_kernels/kv_cache.h"

namespace pdlib::kernels::internal {

class HostKVCache final : public KVCache {
 public:
  static StatusOr<std::unique_ptr<HostKVCache>> Create(const ModelConfig& config, int32_t num_pages,
                                                       int32_t num_state_slots);

 private:
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };

  HostKVCache(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots)
      : KVCache(config, num_pages, num_state_slots, MemoryKind::kHost) {}

  Status CopyToHost(const void* src, void* dst, size_t bytes) const override;
  Status CopyFromHost(const void* src, void* dst, size_t bytes) override;
  StatusOr<PoolRegion> Allocate(size_t bytes, size_t item_bytes);

  std::vector<std::unique_ptr<void, FreeDeleter>> allocations_;
};

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CPU_HOST_KV_CACHE_H_
