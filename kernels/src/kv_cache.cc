#include "pdlib_kernels/kv_cache.h"

#include <string>

namespace pdlib::kernels {

KVCache::KVCache(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots,
                 MemoryKind memory_kind)
    : config_(config),
      num_pages_(num_pages),
      num_state_slots_(num_state_slots),
      memory_kind_(memory_kind) {}

PoolRegion KVCache::pool(KVKind kind, int32_t kv_layer) const {
  const std::vector<PoolRegion>& pools = kind == KVKind::kKey ? k_pools_ : v_pools_;
  if (kv_layer < 0 || static_cast<size_t>(kv_layer) >= pools.size()) return {};
  return pools[static_cast<size_t>(kv_layer)];
}

PoolRegion KVCache::swa_pool(KVKind kind, int32_t swa_layer) const {
  const std::vector<PoolRegion>& pools = kind == KVKind::kKey ? swa_k_pools_ : swa_v_pools_;
  if (swa_layer < 0 || static_cast<size_t>(swa_layer) >= pools.size()) return {};
  return pools[static_cast<size_t>(swa_layer)];
}

PoolRegion KVCache::index_pool(int32_t kv_layer) const {
  if (kv_layer < 0 || static_cast<size_t>(kv_layer) >= index_pools_.size()) return {};
  return index_pools_[static_cast<size_t>(kv_layer)];
}

PoolRegion KVCache::state_pool(int32_t state_layer) const {
  if (state_layer < 0 || static_cast<size_t>(state_layer) >= state_pools_.size()) return {};
  return state_pools_[static_cast<size_t>(state_layer)];
}

namespace {

void Append(BufferFamily* family, const PoolRegion& r) {
  family->ptrs.push_back(reinterpret_cast<uint64_t>(r.base));
  family->lens.push_back(r.bytes);
  family->item_lens.push_back(r.item_bytes);
}

}  // namespace

BufferFamily KVCache::DescribeKV() const {
  BufferFamily family;
  for (const PoolRegion& r : k_pools_) Append(&family, r);
  for (const PoolRegion& r : v_pools_) Append(&family, r);
  return family;
}

BufferFamily KVCache::DescribeSwa() const {
  BufferFamily family;
  for (size_t i = 0; i < swa_k_pools_.size(); ++i) {
    Append(&family, swa_k_pools_[i]);
    Append(&family, swa_v_pools_[i]);
  }
  return family;
}

BufferFamily KVCache::DescribeIndex() const {
  BufferFamily family;
  for (const PoolRegion& r : index_pools_) Append(&family, r);
  return family;
}

BufferFamily KVCache::DescribeState() const {
  BufferFamily family;
  for (const PoolRegion& r : state_pools_) Append(&family, r);
  return family;
}

Status KVCache::CheckPage(PageFamily family, KVKind kind, int32_t layer, int32_t page, size_t bytes,
                          const void** where) const {
  const char* what = family == PageFamily::kSwa     ? "SWA layer "
                     : family == PageFamily::kIndex ? "index layer "
                                                    : "KV layer ";
  const int32_t layers = family == PageFamily::kSwa     ? num_swa_layers()
                         : family == PageFamily::kIndex ? num_index_layers()
                                                        : num_kv_layers();
  if (layer < 0 || layer >= layers) {
    return Status::OutOfRange(
        what + std::to_string(layer) + " out of range [0, " + std::to_string(layers) + ")" +
        (family == PageFamily::kIndex && layers == 0 ? " (the model has no lightning indexer)"
                                                     : ""));
  }
  if (page < 0 || page >= num_pages_) {
    return Status::OutOfRange("page " + std::to_string(page) + " out of range [0, " +
                              std::to_string(num_pages_) + ") for " + what + std::to_string(layer));
  }
  const PoolRegion r = family == PageFamily::kSwa     ? swa_pool(kind, layer)
                       : family == PageFamily::kIndex ? index_pool(layer)
                                                      : pool(kind, layer);
  if (r.base == nullptr) {
    return Status::InvalidArgument(std::string(what) + std::to_string(layer) +
                                   " has no V pool (MLA keeps one latent pool per layer)");
  }
  if (bytes != r.item_bytes) {
    return Status::InvalidArgument("page copy of " + std::to_string(bytes) + " bytes; a page has " +
                                   std::to_string(r.item_bytes));
  }
  *where = static_cast<const std::byte*>(r.base) + static_cast<size_t>(page) * r.item_bytes;
  return Status::OK();
}

Status KVCache::CheckState(int32_t state_layer, int32_t slot, size_t bytes,
                           const void** where) const {
  if (state_layer < 0 || state_layer >= num_state_layers()) {
    return Status::OutOfRange("state layer " + std::to_string(state_layer) + " out of range [0, " +
                              std::to_string(num_state_layers()) + ")");
  }
  if (slot < 0 || slot >= num_state_slots_) {
    return Status::OutOfRange("state slot " + std::to_string(slot) + " out of range [0, " +
                              std::to_string(num_state_slots_) + ")");
  }
  const PoolRegion r = state_pool(state_layer);
  if (bytes != r.item_bytes) {
    return Status::InvalidArgument("state copy of " + std::to_string(bytes) +
                                   " bytes; a slot has " + std::to_string(r.item_bytes));
  }
  *where = static_cast<const std::byte*>(r.base) + static_cast<size_t>(slot) * r.item_bytes;
  return Status::OK();
}

Status KVCache::ReadPage(KVKind kind, int32_t kv_layer, int32_t page,
                         std::span<std::byte> out) const {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kKv, kind, kv_layer, page, out.size(), &where);
  if (!s.ok()) return s;
  return CopyToHost(where, out.data(), out.size());
}

Status KVCache::WritePage(KVKind kind, int32_t kv_layer, int32_t page,
                          std::span<const std::byte> bytes) {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kKv, kind, kv_layer, page, bytes.size(), &where);
  if (!s.ok()) return s;
  return CopyFromHost(bytes.data(), const_cast<void*>(where), bytes.size());
}

Status KVCache::ReadSwaPage(KVKind kind, int32_t swa_layer, int32_t page,
                            std::span<std::byte> out) const {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kSwa, kind, swa_layer, page, out.size(), &where);
  if (!s.ok()) return s;
  return CopyToHost(where, out.data(), out.size());
}

Status KVCache::WriteSwaPage(KVKind kind, int32_t swa_layer, int32_t page,
                             std::span<const std::byte> bytes) {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kSwa, kind, swa_layer, page, bytes.size(), &where);
  if (!s.ok()) return s;
  return CopyFromHost(bytes.data(), const_cast<void*>(where), bytes.size());
}

Status KVCache::ReadIndexPage(int32_t kv_layer, int32_t page, std::span<std::byte> out) const {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kIndex, KVKind::kKey, kv_layer, page, out.size(), &where);
  if (!s.ok()) return s;
  return CopyToHost(where, out.data(), out.size());
}

Status KVCache::WriteIndexPage(int32_t kv_layer, int32_t page, std::span<const std::byte> bytes) {
  const void* where = nullptr;
  Status s = CheckPage(PageFamily::kIndex, KVKind::kKey, kv_layer, page, bytes.size(), &where);
  if (!s.ok()) return s;
  return CopyFromHost(bytes.data(), const_cast<void*>(where), bytes.size());
}

Status KVCache::ReadState(int32_t state_layer, int32_t slot, std::span<float> out) const {
  const void* where = nullptr;
  Status s = CheckState(state_layer, slot, out.size_bytes(), &where);
  if (!s.ok()) return s;
  return CopyToHost(where, out.data(), out.size_bytes());
}

Status KVCache::WriteState(int32_t state_layer, int32_t slot, std::span<const float> in) {
  const void* where = nullptr;
  Status s = CheckState(state_layer, slot, in.size_bytes(), &where);
  if (!s.ok()) return s;
  return CopyFromHost(in.data(), const_cast<void*>(where), in.size_bytes());
}

}  // namespace pdlib::kernels
