#include "bench/transfer/bench_layout.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <unordered_set>
#include <vector>

namespace pdlib_bench {

BenchPool::~BenchPool() {
  pool_.reset();
  std::free(malloced_);
}

std::string BenchPool::Allocate(const BenchConfig& c, Fill fill, pdlib::Mode mode) {
  buffers_ = 2 * c.layers;
  buffer_bytes_ = c.PoolPages() * c.item_bytes;
  const uint64_t bytes = buffers_ * buffer_bytes_;
  if (c.memory == pdlib::MemoryKind::kCuda) return AllocateCuda(c, fill, bytes);
  if (c.pool_alloc == PoolAlloc::kMalloc) {
    malloced_ = std::malloc(bytes);
    if (malloced_ == nullptr) return "malloc of " + std::to_string(bytes) + " bytes failed";
    base_ = static_cast<uint8_t*>(malloced_);
    allocator_ = "malloc";
  } else {
    auto pool =
        pdlib::AllocateKVPool(c.backend, bytes, pdlib::MemoryKind::kHost, c.backend_options, mode);
    if (!pool.ok()) return "AllocateKVPool: " + pool.status().ToString();
    pool_ = std::move(*pool);
    base_ = static_cast<uint8_t*>(pool_->data());
    allocator_ = std::string(pool_->allocator());
  }
  if (fill == Fill::kPattern) {
    for (uint64_t off = 0; off + 8 <= bytes; off += 8) std::memcpy(base_ + off, &off, 8);
  } else if (fill == Fill::kZero) {
    std::memset(base_, 0, bytes);
  }
  return "";
}

std::string BenchPool::AllocateCuda(const BenchConfig& c, Fill fill, uint64_t bytes) {
  cuda_device_ = c.cuda_device;
  if (std::string e = CudaBuffer::Allocate(cuda_device_, bytes, &cuda_); !e.empty()) return e;
  base_ = cuda_->data();
  allocator_ = "cudaMalloc";
  // Zeroes first (also the tail a pattern of 8-byte words leaves), then the same pattern as in
  // host memory, through a bounded host buffer.
  if (std::string e = CudaZero(cuda_device_, base_, bytes); !e.empty() || fill != Fill::kPattern) {
    return e;
  }
  std::vector<uint64_t> words;
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  for (uint64_t at = 0; at < bytes; at += kChunk) {
    const uint64_t n = std::min(kChunk, bytes - at);
    words.resize(n / 8);
    for (uint64_t i = 0; i < words.size(); ++i) words[i] = at + i * 8;
    if (std::string e = CudaCopyToDevice(cuda_device_, base_ + at, words.data(), words.size() * 8);
        !e.empty()) {
      return e;
    }
  }
  return "";
}

std::string BenchPool::Read(uint64_t b, uint64_t offset, std::span<uint8_t> out) const {
  const uint8_t* from = buffer(b) + offset;
  if (cuda_) return CudaCopyToHost(cuda_device_, out.data(), from, out.size());
  std::memcpy(out.data(), from, out.size());
  return "";
}

std::string BenchPool::Zero(uint64_t b, uint64_t offset, uint64_t length) {
  uint8_t* at = buffer(b) + offset;
  if (cuda_) return CudaZero(cuda_device_, at, length);
  std::memset(at, 0, length);
  return "";
}

bool HoldsPattern(const uint8_t* data, uint64_t length, uint64_t pool_offset) {
  for (uint64_t i = 0; i + 8 <= length; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, data + i, 8);
    if (word != pool_offset + i) return false;
  }
  return true;
}

PageRing::PageRing(const BenchConfig& c, uint64_t seed) : pages_(c.pages) {
  const uint64_t pool = c.PoolPages();
  slots_ = std::min<uint64_t>(kPageRing, c.warmup + c.requests);
  // With a checksum the requests in flight must not share pages (no engine gives one page to two
  // live requests; a shared one is overwritten before its digest is checked, a true mismatch):
  // each request draws its scattered pages from a window of the pool, twice as many windows as
  // requests in flight, and decode does not start one whose window a live request holds
  // (requests end out of order, so the ring alone does not keep them apart).
  uint64_t windows = 0, width = 0;
  if (c.checksum != pdlib::KvChecksum::kOff && c.layout == Layout::kScattered) {
    width = std::max<uint64_t>(pages_, pool / std::max<uint64_t>(1, 2 * c.concurrency));
    windows = std::max<uint64_t>(1, pool / width);
    if (slots_ > windows) slots_ -= slots_ % windows;
  }
  windows_ = windows;
  ring_.reserve(slots_ * pages_);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> all;
  for (uint64_t s = 0; s < slots_; ++s) {
    if (windows > 0) {
      const uint64_t base = (s % windows) * width;
      std::unordered_set<int32_t> seen;
      while (seen.size() < pages_) {
        const auto p = int32_t(base + rng() % width);
        if (seen.insert(p).second) ring_.push_back(p);
      }
    } else if (c.layout == Layout::kContiguous) {
      const uint64_t start = (s % std::max<uint64_t>(1, pool / pages_)) * pages_;
      for (uint64_t k = 0; k < pages_; ++k) ring_.push_back(int32_t(start + k));
    } else if (pages_ * 4 <= pool) {
      // Distinct random pages in random order: almost nothing coalesces.
      std::unordered_set<int32_t> seen;
      while (seen.size() < pages_) {
        const auto p = int32_t(rng() % pool);
        if (seen.insert(p).second) ring_.push_back(p);
      }
    } else {
      if (all.empty()) {
        for (uint64_t p = 0; p < pool; ++p) all.push_back(int32_t(p));
      }
      std::shuffle(all.begin(), all.end(), rng);
      ring_.insert(ring_.end(), all.begin(), all.begin() + std::ptrdiff_t(pages_));
    }
  }
}

}  // namespace pdlib_bench
