#include "examples/scheduler/kernels_runner.h"

#include <cstring>
#include <string>

namespace pdlib::sched {

Status KernelsModelRunner::Forward(std::span<const ForwardChunk> batch,
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
  const kernels::KVCache& cache = model_->kv_cache();
  if (cache.num_kv_layers() == 0) return 0;
  return 2ull * static_cast<uint64_t>(cache.num_kv_layers()) *
         cache.pool(kernels::KVKind::kKey, 0).item_bytes;
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
  for (int32_t layer = 0; layer < cache.num_kv_layers(); ++layer) {
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      const size_t page_bytes = cache.pool(kind, layer).item_bytes;
      for (int32_t i = 0; i < pages; ++i) {
        kv.bytes.resize(kv.bytes.size() + page_bytes);
        std::span<std::byte> out(kv.bytes.data() + kv.bytes.size() - page_bytes, page_bytes);
        if (Status s = cache.ReadPage(kind, layer, page_table[static_cast<size_t>(i)], out);
            !s.ok()) {
          return s;
        }
      }
    }
  }
  if (state_slot >= 0) {
    const size_t dim = static_cast<size_t>(cache.config().state_dim());
    for (int32_t layer = 0; layer < cache.num_state_layers(); ++layer) {
      std::vector<float> state(dim);
      if (Status s = cache.ReadState(layer, state_slot, state); !s.ok()) return s;
      const auto* p = reinterpret_cast<const std::byte*>(state.data());
      kv.bytes.insert(kv.bytes.end(), p, p + dim * sizeof(float));
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
  for (int32_t layer = 0; layer < cache.num_kv_layers(); ++layer) {
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      const size_t page_bytes = cache.pool(kind, layer).item_bytes;
      for (int32_t i = 0; i < pages; ++i) {
        std::span<const std::byte> in = take(page_bytes);
        if (in.empty()) return Status::InvalidArgument("RestoreKV: host copy is too short");
        if (Status s = cache.WritePage(kind, layer, page_table[static_cast<size_t>(i)], in);
            !s.ok()) {
          return s;
        }
      }
    }
  }
  if (state_slot >= 0) {
    const size_t dim = static_cast<size_t>(cache.config().state_dim());
    for (int32_t layer = 0; layer < cache.num_state_layers(); ++layer) {
      std::span<const std::byte> in = take(dim * sizeof(float));
      if (in.empty()) return Status::InvalidArgument("RestoreKV: host copy has no state");
      std::vector<float> state(dim);
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
