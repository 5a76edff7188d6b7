#include "cpu/host_kv_cache.h"

#include <cstring>
#include <string>

namespace pdlib::kernels::internal {
namespace {

// Page alignment lets RDMA and GPU-direct registration pin the pools without slack.
constexpr size_t kAlignment = 4096;

}  // namespace

StatusOr<std::unique_ptr<HostKVCache>> HostKVCache::Create(const ModelConfig& config,
                                                           int32_t num_pages,
                                                           int32_t num_state_slots) {
  std::unique_ptr<HostKVCache> cache(new HostKVCache(config, num_pages, num_state_slots));
  const size_t page_bytes = config.kv_page_bytes();
  auto add_pages = [&](std::vector<PoolRegion>* pools) -> Status {
    StatusOr<PoolRegion> r =
        cache->Allocate(page_bytes * static_cast<size_t>(num_pages), page_bytes);
    if (!r.ok()) return r.status();
    pools->push_back(*r);
    return Status::OK();
  };
  for (int32_t l = 0; l < config.num_attention_layers(); ++l) {
    if (Status s = add_pages(&cache->k_pools_); !s.ok()) return s;
    if (config.is_mla()) continue;  // one latent pool per layer
    if (Status s = add_pages(&cache->v_pools_); !s.ok()) return s;
  }
  if (config.has_indexer()) {
    // One index pool per full attention layer, pages parallel to the KV pools'.
    const size_t index_bytes = config.index_page_bytes();
    for (int32_t l = 0; l < config.num_attention_layers(); ++l) {
      StatusOr<PoolRegion> r =
          cache->Allocate(index_bytes * static_cast<size_t>(num_pages), index_bytes);
      if (!r.ok()) return r.status();
      cache->index_pools_.push_back(*r);
    }
  }
  for (int32_t l = 0; l < config.num_swa_layers(); ++l) {
    if (Status s = add_pages(&cache->swa_k_pools_); !s.ok()) return s;
    if (Status s = add_pages(&cache->swa_v_pools_); !s.ok()) return s;
  }
  const size_t slot_bytes = config.state_slot_bytes();
  for (int32_t l = 0; l < config.num_recurrent_layers(); ++l) {
    StatusOr<PoolRegion> r =
        cache->Allocate(slot_bytes * static_cast<size_t>(num_state_slots), slot_bytes);
    if (!r.ok()) return r.status();
    cache->state_pools_.push_back(*r);
  }
  return cache;
}

StatusOr<PoolRegion> HostKVCache::Allocate(size_t bytes, size_t item_bytes) {
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (p == nullptr) {
    return Status::ResourceExhausted("KV cache: cannot allocate " + std::to_string(rounded) +
                                     " bytes of host memory");
  }
  std::memset(p, 0, rounded == 0 ? kAlignment : rounded);
  allocations_.emplace_back(p);
  return PoolRegion{p, bytes, item_bytes};
}

Status HostKVCache::CopyToHost(const void* src, void* dst, size_t bytes) const {
  std::memcpy(dst, src, bytes);
  return Status::OK();
}

Status HostKVCache::CopyFromHost(const void* src, void* dst, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::OK();
}

}  // namespace pdlib::kernels::internal
