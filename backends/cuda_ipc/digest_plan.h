// The host half of the GPU digest kernel (digest_kernel.h): its tables and how the ranges it is
// given split into the tiles its blocks take. Pure C++, built in every configuration and tested
// without a GPU (test/cuda_ipc/digest_math_test.cc), as copy_plan.h is for the gather kernel.
#ifndef PDLIB_BACKENDS_CUDA_IPC_DIGEST_PLAN_H_
#define PDLIB_BACKENDS_CUDA_IPC_DIGEST_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda_ipc/digest_math.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// One block's work: `length` bytes at `addr` (at most kDigestTileBytes), part of range `range`,
// whose raw CRC is shifted past the `after` bytes that follow it in the range (its own bytes and
// the range's zeros_after) before it is XORed into crcs[range].
struct DigestTile {
  uint64_t addr = 0;
  uint64_t after = 0;
  uint32_t length = 0;
  uint32_t range = 0;
};
static_assert(sizeof(DigestTile) == 24);

// The kernel's tables, computed once (lib/base/crc32c.h's arithmetic).
const DigestTables& HostDigestTables();

// The tiles of `ranges`, in order; empty ranges have none (their CRC is 0).
std::vector<DigestTile> PlanDigestTiles(std::span<const spi::DigestRange> ranges);

// The kernel's computation on the CPU, thread by thread and block by block in the same
// decomposition, over host memory: what the GPU test compares the device with, and what the
// tests without a GPU compare with lib/base's CRC32C.
void DigestTilesOnCpu(std::span<const DigestTile> tiles, std::span<uint32_t> crcs);

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_DIGEST_PLAN_H_
