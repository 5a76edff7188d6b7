// What pdlib-transfer-bench's ranks and its memcpy baseline share: the KV pool of one side (one
// allocation holding every K and V buffer, one after the other) and the pages of each request.
//
// Threads: a BenchPool is used by one thread at a time; a PageRing is immutable once built.
#ifndef PDLIB_BENCH_TRANSFER_BENCH_LAYOUT_H_
#define PDLIB_BENCH_TRANSFER_BENCH_LAYOUT_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bench/transfer/bench_ranks.h"
#include "bench/transfer/cuda_memory.h"
#include "pdlib/kv_pool.h"

namespace pdlib_bench {

// The 2 * layers KV buffers of one side, PoolPages() items each, in one allocation made as
// --pool-alloc says: through pdlib::AllocateKVPool (the backend's allocator when it has one) or
// with malloc; with --memory cuda, with cudaMalloc on --cuda-device (cuda_memory.h).
class BenchPool {
 public:
  BenchPool() = default;
  ~BenchPool();
  BenchPool(const BenchPool&) = delete;
  BenchPool& operator=(const BenchPool&) = delete;

  // Returns an error message, or "" on success. kPattern and kZero write every page (each 8-byte
  // word holding its own offset in the pool, or zeroes) so that the kernel backs it before anything
  // is timed; kLazy touches nothing (for the fake backend, which never touches memory: a large pool
  // then costs nothing).
  enum class Fill { kPattern, kZero, kLazy };
  // `mode`: the side whose manager registers the pool (AllocateKVPool allocates there).
  std::string Allocate(const BenchConfig& c, Fill fill, pdlib::Mode mode);

  // The address of buffer b: host memory, or device memory with --memory cuda.
  uint8_t* buffer(uint64_t b) const { return base_ + b * buffer_bytes_; }
  uint64_t buffer_bytes() const { return buffer_bytes_; }
  uint64_t buffers() const { return buffers_; }
  // "ucx", "host" (AllocateKVPool without a backend allocator), "malloc" or "cudaMalloc".
  std::string allocator() const { return allocator_; }
  // Copies `out.size()` bytes at `offset` of buffer b into host memory (from the GPU with
  // --memory cuda); returns an error message or "".
  std::string Read(uint64_t b, uint64_t offset, std::span<uint8_t> out) const;
  // Zeroes `length` bytes at `offset` of buffer b (on the GPU with --memory cuda); returns an
  // error message or "".
  std::string Zero(uint64_t b, uint64_t offset, uint64_t length);

 private:
  std::string AllocateCuda(const BenchConfig& c, Fill fill, uint64_t bytes);

  std::unique_ptr<CudaBuffer> cuda_;
  int cuda_device_ = 0;
  std::unique_ptr<pdlib::KVPool> pool_;
  void* malloced_ = nullptr;
  uint8_t* base_ = nullptr;
  uint64_t buffer_bytes_ = 0, buffers_ = 0;
  std::string allocator_;
};

// Whether `length` bytes at `data` are what a kPattern pool holds at `pool_offset` (8-aligned).
bool HoldsPattern(const uint8_t* data, uint64_t length, uint64_t pool_offset);

// Page indices of request i: `pages` of them, at ring[(i % slots) * pages]. Precomputed for at
// most kPageRing requests and reused in a ring, so the timed loops draw no random numbers.
// scattered: distinct pages at random in the whole pool; contiguous: consecutive pages, the
// requests walking through the pool.
class PageRing {
 public:
  static constexpr uint64_t kPageRing = 4096;
  PageRing(const BenchConfig& c, uint64_t seed);
  std::span<const int32_t> For(uint64_t i) const {
    return std::span(ring_).subspan((i % slots_) * pages_, pages_);
  }
  uint64_t slots() const { return slots_; }
  // With a checksum (scattered): the window of the pool request i draws its pages from; two
  // requests in flight must not hold the same one (DriveDecode waits). 0 windows: no rule.
  uint64_t windows() const { return windows_; }
  uint64_t Window(uint64_t i) const { return windows_ == 0 ? 0 : (i % slots_) % windows_; }

 private:
  uint64_t pages_;
  uint64_t slots_ = 1;
  uint64_t windows_ = 0;
  std::vector<int32_t> ring_;
};

// The seeds of each side's pages: the ranks and the baseline must draw the same ones.
inline uint64_t PrefillPageSeed(const BenchConfig& c) { return c.seed * 2 + 1; }
inline uint64_t DecodePageSeed(const BenchConfig& c) { return c.seed * 2 + 2; }

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_BENCH_LAYOUT_H_
