// DeviceDigester on a real GPU: random ranges (whole 32 KiB items, head slices, odd lengths and
// offsets, zeros after) over cudaMalloc'ed bytes, compared with lib/base's CRC32C of a host copy
// and with DigestTilesOnCpu; a flipped byte on the device changes exactly its range; the digest
// waits for the work queued on the stream it is given. Without a usable device every case says
// why (the CUDA runtime's error) and passes without checking anything.
#include "backends/cuda_ipc/digest_kernel.h"

#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <random>
#include <vector>

#include "backends/cuda_ipc/digest_plan.h"
#include "lib/base/crc32c.h"
#include "test/cuda_ipc/copy_batches.h"

namespace pdlib::cuda_ipc {
namespace {

using testing::RandomBytes;

std::unique_ptr<DeviceDigester> DigesterOrSkip() {
  auto d = DeviceDigester::Create(0);
  if (!d.ok()) {
    REQUIRE(d.status().code() == StatusCode::kUnavailable);
    WARN("SKIP: no GPU for the digest kernel: " << d.status().ToString());
    return nullptr;
  }
  return std::move(d).value();
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) { REQUIRE(cudaMalloc(&ptr, n) == cudaSuccess); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(ptr); }
  void* ptr = nullptr;
};

uint32_t Reference(const std::vector<uint8_t>& host, uint64_t off, uint64_t n, uint64_t zeros) {
  return Crc32cMulMod(Crc32cRaw(0, host.data() + off, n), Crc32cZerosFactor(zeros));
}

TEST_CASE("digest kernel: random ranges equal CRC32C of the same bytes on the host") {
  auto digester = DigesterOrSkip();
  if (!digester) return;
  constexpr size_t kSize = 8 << 20;
  std::mt19937_64 rng(11);
  const std::vector<uint8_t> host = RandomBytes(rng, kSize);
  DeviceBuffer dev(kSize);
  REQUIRE(cudaMemcpy(dev.ptr, host.data(), kSize, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  for (int round = 0; round < 40; ++round) {
    INFO("round " << round);
    std::vector<spi::DigestRange> ranges;
    std::vector<uint64_t> offsets;
    const int n = 1 + static_cast<int>(rng() % 300);
    for (int i = 0; i < n; ++i) {
      uint64_t len = 0;
      switch (rng() % 4) {
        case 0: len = 32768; break;
        case 1: len = 256 * (1 + rng() % 64); break;
        case 2: len = rng() % 200000; break;
        default: len = rng() % 130; break;
      }
      const uint64_t off = (rng() % 2 == 0 ? 0 : rng() % 16) + 64 * (rng() % 100000);
      len = std::min<uint64_t>(len, kSize - off);
      const uint64_t zeros = rng() % 3 == 0 ? 0 : rng() % 100000;
      ranges.push_back({dev.addr() + off, len, zeros});
      offsets.push_back(off);
    }
    std::vector<uint32_t> got(ranges.size());
    REQUIRE(digester->Digest(ranges, got).ok());
    for (size_t i = 0; i < ranges.size(); ++i) {
      INFO("range " << i << ": " << ranges[i].length << " bytes at +" << offsets[i]);
      REQUIRE(got[i] == Reference(host, offsets[i], ranges[i].length, ranges[i].zeros_after));
    }
  }
  CHECK(digester->launches() == 40);
}

TEST_CASE("digest kernel: a byte changed on the device changes its range only") {
  auto digester = DigesterOrSkip();
  if (!digester) return;
  constexpr size_t kItems = 64, kItem = 32768;
  std::mt19937_64 rng(12);
  const std::vector<uint8_t> host = RandomBytes(rng, kItems * kItem);
  DeviceBuffer dev(host.size());
  REQUIRE(cudaMemcpy(dev.ptr, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<spi::DigestRange> ranges;
  for (size_t i = 0; i < kItems; ++i) ranges.push_back({dev.addr() + i * kItem, kItem, 0});
  std::vector<uint32_t> before(kItems), after(kItems);
  REQUIRE(digester->Digest(ranges, before).ok());
  // The change is queued on another stream; the digest must wait for it.
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const uint8_t flipped = static_cast<uint8_t>(host[17 * kItem + 999] ^ 0x40);
  REQUIRE(cudaMemcpyAsync(static_cast<uint8_t*>(dev.ptr) + 17 * kItem + 999, &flipped, 1,
                          cudaMemcpyHostToDevice, stream) == cudaSuccess);
  REQUIRE(digester->Digest(ranges, after, stream).ok());
  for (size_t i = 0; i < kItems; ++i) {
    INFO("item " << i);
    CHECK((before[i] != after[i]) == (i == 17));
  }
  (void)cudaStreamDestroy(stream);
}

TEST_CASE("digest kernel: empty input, empty ranges, and too few outputs") {
  auto digester = DigesterOrSkip();
  if (!digester) return;
  std::vector<uint32_t> none;
  CHECK(digester->Digest({}, none).ok());
  DeviceBuffer dev(64);
  const std::vector<spi::DigestRange> empty = {{dev.addr(), 0, 12345}};
  std::vector<uint32_t> one = {7};
  REQUIRE(digester->Digest(empty, one).ok());
  CHECK(one[0] == 0);
  CHECK(digester->Digest(empty, none).code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdlib::cuda_ipc
