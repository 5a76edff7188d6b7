#include "examples/scheduler/kernels_runner.h"

#include <cstring>
#include <string>
#include <vector>

namespace pdlib::sched {
namespace {

// One page-sized pool the runner offloads: a K or V pool of a full-attention layer (MLA: the K
// pool only; its V pool is empty), of a sliding-window layer, or an indexer's key pool.
enum class Family { kKv, kSwa, kIndex };
struct PagePool {
  Family family = Family::kKv;
  kernels::KVKind kind = kernels::KVKind::kKey;
  int32_t layer = 0;
  size_t page_bytes = 0;

  Status Read(const kernels::KVCache& cache, int32_t page, std::span<std::byte> out) const {
    switch (family) {
      case Family::kKv: return cache.ReadPage(kind, layer, page, out);
      case Family::kSwa: return cache.ReadSwaPage(kind, layer, page, out);
      case Family::kIndex: return cache.ReadIndexPage(layer, page, out);
    }
    return Status::Internal("unknown page pool");
  }
  Status Write(kernels::KVCache& cache, int32_t page, std::span<const std::byte> in) const {
    switch (family) {
      case Family::kKv: return cache.WritePage(kind, layer, page, in);
      case Family::kSwa: return cache.WriteSwaPage(kind, layer, page, in);
      case Family::kIndex: return cache.WriteIndexPage(layer, page, in);
    }
    return Status::Internal("unknown page pool");
  }
};

// Every non-empty page pool of the cache (this rank's share of a sharded model), in a fixed
// order: per full-attention layer K then V, per sliding-window layer K then V, per indexer.
std::vector<PagePool> PagePools(const kernels::KVCache& cache) {
  std::vector<PagePool> out;
  auto add = [&](Family family, kernels::KVKind kind, int32_t layer, kernels::PoolRegion p) {
    if (p.base != nullptr && p.item_bytes > 0) out.push_back({family, kind, layer, p.item_bytes});
  };
  for (int32_t layer = 0; layer < cache.num_kv_layers(); ++layer) {
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      add(Family::kKv, kind, layer, cache.pool(kind, layer));
    }
  }
  for (int32_t layer = 0; layer < cache.num_swa_layers(); ++layer) {
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      add(Family::kSwa, kind, layer, cache.swa_pool(kind, layer));
    }
  }
  for (int32_t layer = 0; layer < cache.num_index_layers(); ++layer) {
    add(Family::kIndex, kernels::KVKind::kKey, layer, cache.index_pool(layer));
  }
  return out;
}

size_t StateFloats(const kernels::KVCache& cache, int32_t layer) {
  return cache.state_pool(layer).item_bytes / sizeof(float);
}

}  // namespace

Status KernelsModelRunner::Forward(std::span<const ForwardChunk> batch,
                                   std::vector<ForwardOutput>* results) {
  return ForwardStreaming(batch, {}, results);
}

Status KernelsModelRunner::ForwardStreaming(std::span<const ForwardChunk> batch,
                                            const std::function<void(int32_t)>& kv_layers_done,
                                            std::vector<ForwardOutput>* results) {
  std::vector<kernels::SequenceChunk> chunks;
  chunks.reserve(batch.size());
  for (const ForwardChunk& c : batch) {
    chunks.push_back({.tokens = c.tokens,
                      .start_pos = c.start_pos,
                      .page_table = c.page_table,
                      .state_slot = c.state_slot});
  }
  std::vector<kernels::ForwardResult> out;
  kernels::ForwardOptions options;
  options.top_k = top_k_;
  options.on_kv_layers_done = kv_layers_done;
  if (Status s = model_->Forward(chunks, options, &out); !s.ok()) return s;
  results->clear();
  for (auto& r : out) {
    results->push_back({.token = r.token,
                        .logprob = r.logprob,
                        .top_ids = std::move(r.top_ids),
                        .top_logprobs = std::move(r.top_logprobs)});
  }
  return Status::OK();
}

uint64_t KernelsModelRunner::kv_bytes_per_page() const {
  uint64_t bytes = 0;
  for (const PagePool& p : PagePools(model_->kv_cache())) {
    if (p.family == Family::kKv) bytes += p.page_bytes;
  }
  return bytes;
}

uint64_t KernelsModelRunner::page_state_bytes_per_page() const {
  uint64_t bytes = 0;
  for (const PagePool& p : PagePools(model_->kv_cache())) {
    if (p.family != Family::kKv) bytes += p.page_bytes;
  }
  return bytes;
}

StatusOr<HostKV> KernelsModelRunner::OffloadKV(std::span<const int32_t> page_table,
                                               int64_t num_tokens, int32_t state_slot) {
  const kernels::KVCache& cache = model_->kv_cache();
  const int32_t pages = kernels::PagesForTokens(num_tokens, cache.config().page_size);
  if (pages > static_cast<int32_t>(page_table.size())) {
    return Status::InvalidArgument("OffloadKV: " + std::to_string(num_tokens) + " tokens need " +
                                   std::to_string(pages) + " pages, the page table has " +
                                   std::to_string(page_table.size()));
  }
  HostKV kv;
  kv.num_tokens = num_tokens;
  for (const PagePool& p : PagePools(cache)) {
    for (int32_t i = 0; i < pages; ++i) {
      kv.bytes.resize(kv.bytes.size() + p.page_bytes);
      std::span<std::byte> out(kv.bytes.data() + kv.bytes.size() - p.page_bytes, p.page_bytes);
      const int32_t page = page_table[static_cast<size_t>(i)];
      if (Status s = p.Read(cache, page, out); !s.ok()) return s;
    }
  }
  if (state_slot >= 0) {
    for (int32_t layer = 0; layer < cache.num_state_layers(); ++layer) {
      std::vector<float> state(StateFloats(cache, layer));
      if (Status s = cache.ReadState(layer, state_slot, state); !s.ok()) return s;
      const auto* p = reinterpret_cast<const std::byte*>(state.data());
      kv.bytes.insert(kv.bytes.end(), p, p + state.size() * sizeof(float));
    }
  }
  return kv;
}

Status KernelsModelRunner::RestoreKV(const HostKV& kv, std::span<const int32_t> page_table,
                                     int32_t state_slot) {
  kernels::KVCache& cache = model_->kv_cache();
  const int32_t pages = kernels::PagesForTokens(kv.num_tokens, cache.config().page_size);
  if (pages > static_cast<int32_t>(page_table.size())) {
    return Status::InvalidArgument("RestoreKV: " + std::to_string(kv.num_tokens) + " tokens need " +
                                   std::to_string(pages) + " pages, the page table has " +
                                   std::to_string(page_table.size()));
  }
  size_t at = 0;
  auto take = [&](size_t n) -> std::span<const std::byte> {
    if (at + n > kv.bytes.size()) return {};
    std::span<const std::byte> s(kv.bytes.data() + at, n);
    at += n;
    return s;
  };
  for (const PagePool& p : PagePools(cache)) {
    for (int32_t i = 0; i < pages; ++i) {
      std::span<const std::byte> in = take(p.page_bytes);
      if (in.empty()) return Status::InvalidArgument("RestoreKV: host copy is too short");
      const int32_t page = page_table[static_cast<size_t>(i)];
      if (Status s = p.Write(cache, page, in); !s.ok()) return s;
    }
  }
  if (state_slot >= 0) {
    for (int32_t layer = 0; layer < cache.num_state_layers(); ++layer) {
      const size_t floats = StateFloats(cache, layer);
      std::span<const std::byte> in = take(floats * sizeof(float));
      if (in.empty()) return Status::InvalidArgument("RestoreKV: host copy has no state");
      std::vector<float> state(floats);
      std::memcpy(state.data(), in.data(), in.size());
      if (Status s = cache.WriteState(layer, state_slot, state); !s.ok()) return s;
    }
  }
  if (at != kv.bytes.size()) {
    return Status::InvalidArgument("RestoreKV: host copy has " + std::to_string(kv.bytes.size()) +
                                   " bytes, expected " + std::to_string(at));
  }
  return Status::OK();
}

}  // namespace pdlib::sched
