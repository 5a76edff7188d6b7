// GatherCopier on a real GPU: random descriptor batches (aligned and unaligned, every vector
// width, split and grouped tiles) over cudaMalloc'ed buffers, compared byte for byte with
// ExecuteOnCpu on host copies of the same buffers. Without a usable device every case says why
// (the CUDA runtime's error) and passes without checking anything.
#include "backends/cuda_ipc/gather_copy.h"

#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test/cuda_ipc/copy_batches.h"

namespace pdlib::cuda_ipc {
namespace {

using testing::Diff;
using testing::RandomBatch;
using testing::RandomBytes;
using testing::Rebase;

// The copier on device 0, or null after a WARN with the reason there is none.
std::unique_ptr<GatherCopier> CopierOrSkip() {
  StatusOr<std::unique_ptr<GatherCopier>> copier = GatherCopier::Create(0);
  if (!copier.ok()) {
    REQUIRE(copier.status().code() == StatusCode::kUnavailable);
    WARN("SKIP: no GPU for the gather kernel: " << copier.status().ToString());
    return nullptr;
  }
  return std::move(copier).value();
}

// A device buffer freed at scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) { REQUIRE(cudaMalloc(&ptr, n) == cudaSuccess); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(ptr); }
  void* ptr = nullptr;
};

void CheckBatches(bool aligned, uint64_t seed) {
  std::unique_ptr<GatherCopier> copier = CopierOrSkip();
  if (!copier) return;
  constexpr uint64_t kSize = 4 << 20;
  std::mt19937_64 rng(seed);
  const std::vector<uint8_t> src = RandomBytes(rng, kSize);
  const std::vector<uint8_t> fill = RandomBytes(rng, kSize);
  DeviceBuffer dsrc(kSize), ddst(kSize);
  REQUIRE(cudaMemcpy(dsrc.ptr, src.data(), kSize, cudaMemcpyHostToDevice) == cudaSuccess);
  // The copier's stream is non-blocking: it does not wait for the legacy stream's copies, and a
  // copy from pageable memory may return before its bytes landed (seen on an H200: round 27 read a
  // byte of `fill` that landed after the kernel). Every setup copy is synchronised first.
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  for (int round = 0; round < 40; ++round) {
    INFO("round " << round << (aligned ? " aligned" : " unaligned"));
    const std::vector<ResolvedCopy> copies =
        RandomBatch(rng, kSize, kSize, aligned, 1 + round % 40);
    // Host reference over host copies of both buffers.
    std::vector<uint8_t> want = fill;
    std::vector<CopyDesc> descs;
    CoalesceCopies(Rebase(copies, reinterpret_cast<uint64_t>(src.data()),
                          reinterpret_cast<uint64_t>(want.data())),
                   &descs);
    ExecuteOnCpu(descs);
    // The same batch on the GPU; `descs` is overwritten at once to show Enqueue kept its copy.
    REQUIRE(cudaMemcpy(ddst.ptr, fill.data(), kSize, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CoalesceCopies(Rebase(copies, dsrc.addr(), ddst.addr()), &descs);
    REQUIRE(copier->Enqueue(descs, stream).ok());
    std::fill(descs.begin(), descs.end(), CopyDesc{});
    std::vector<uint8_t> got(kSize);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaMemcpy(got.data(), ddst.ptr, kSize, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(Diff(got, want) == "");
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("gather copy: random 16-aligned batches match the CPU reference") {
  CheckBatches(true, 1);
}

TEST_CASE("gather copy: random unaligned batches match the CPU reference") {
  CheckBatches(false, 2);
}

TEST_CASE("gather copy: many batches in flight on two streams reuse the ring safely") {
  std::unique_ptr<GatherCopier> copier = CopierOrSkip();
  if (!copier) return;
  // Each batch copies its own 64 KiB block through 256-byte strided rows; more batches than
  // ring slots are in flight before anything is synchronised.
  constexpr int kBatches = 3 * GatherCopier::kRingSlots + 1;
  constexpr uint64_t kBlock = 64 << 10;
  std::mt19937_64 rng(3);
  const std::vector<uint8_t> src = RandomBytes(rng, kBlock * kBatches);
  DeviceBuffer dsrc(src.size()), ddst(src.size());
  REQUIRE(cudaMemcpy(dsrc.ptr, src.data(), src.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemset(ddst.ptr, 0, src.size()) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the streams below are non-blocking
  cudaStream_t streams[2] = {nullptr, nullptr};
  for (auto& s : streams)
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  std::vector<uint8_t> want(src.size(), 0);
  for (int b = 0; b < kBatches; ++b) {
    // Rows of 256 bytes, reversed order inside the block (one descriptor per row).
    std::vector<CopyDesc> descs;
    const uint64_t base = static_cast<uint64_t>(b) * kBlock;
    for (uint64_t row = 0; row < kBlock / 256; ++row) {
      const uint64_t from = base + row * 256;
      const uint64_t to = base + kBlock - (row + 1) * 256;
      descs.push_back({dsrc.addr() + from, ddst.addr() + to, 256, 1, 0, 0});
      std::memcpy(want.data() + to, src.data() + from, 256);
    }
    REQUIRE(copier->Enqueue(descs, streams[b % 2]).ok());
  }
  CHECK(copier->Enqueue({}, streams[0]).ok());
  for (auto& s : streams) REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<uint8_t> got(src.size());
  REQUIRE(cudaMemcpy(got.data(), ddst.ptr, got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(Diff(got, want) == "");
  for (auto& s : streams) REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("gather copy: invalid descriptors are refused before anything runs") {
  std::unique_ptr<GatherCopier> copier = CopierOrSkip();
  if (!copier) return;
  const std::vector<CopyDesc> overlap = {{0x1000, 0x2000, 64, 2, 64, 32}};
  CHECK(copier->Enqueue(overlap, nullptr).code() == StatusCode::kInvalidArgument);
  CHECK(GatherCopier::Create(1 << 20).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdlib::cuda_ipc
