// Copy descriptors for the cuda_ipc backend (issue #19): a batch of planner writes, resolved to
// absolute addresses, becomes a short list of strided descriptors that one GatherCopier kernel
// performs in one pass. M:N tensor parallelism slices heads: an HND head slice is one piece per
// page, an NHD head slice page_size pieces per page at constant strides; coalescing turns those
// back into one descriptor per page (or per run of consecutive pages).
//
// Pure arithmetic, no CUDA, no I/O, no threads: every function may be called from any thread.
// tile_map.h holds the per-tile address arithmetic the kernel runs; it is compiled here as well,
// so that ExecuteTilesOnCpu runs the kernel's decomposition on the CPU in every build.
//
// Limits (what CoalesceCopies produces and GatherCopier::Enqueue checks, ValidateDescs):
// - bytes >= 1 and count >= 1 (CoalesceCopies drops zero-byte copies);
// - no piece wraps the address space: src + (count-1)*src_stride + bytes <= 2^64, the same for
//   dst, computed without overflow (a copy's own src + bytes must not wrap; CoalesceCopies
//   checks every merge with overflow-checked arithmetic and does not merge otherwise);
// - strides move forward only (they are unsigned), and the pieces of one descriptor do not
//   overlap on the destination (count == 1 or dst_stride >= bytes): the kernel writes pieces in
//   no particular order;
// - the caller's side of the contract, not checked: the destinations of different descriptors
//   do not overlap either, and no destination overlaps a source. ExecuteOnCpu is sequential and
//   defines the result only where that holds.
#ifndef PDLIB_BACKENDS_CUDA_IPC_COPY_PLAN_H_
#define PDLIB_BACKENDS_CUDA_IPC_COPY_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda_ipc/tile_map.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// One copy with absolute addresses (a planner write, resolved).
struct ResolvedCopy {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

// `count` pieces of `bytes`: piece i goes from src + i*src_stride to dst + i*dst_stride.
struct CopyDesc {
  uint64_t src = 0, dst = 0, bytes = 0, count = 1, src_stride = 0, dst_stride = 0;
  friend bool operator==(const CopyDesc&, const CopyDesc&) = default;
};

// Merges the batch into as few descriptors as a greedy pass finds without changing what is
// written: each copy extends the last descriptor when it can, else starts a new one.
// - Pieces contiguous on both sides (the next copy starts where the last descriptor, a single
//   piece, ends on both sides) become one longer piece (runs of whole pages).
// - A run of consecutive copies of equal `bytes` whose src and dst advance by constant forward
//   strides becomes one descriptor (the NHD head slice: page_size pieces per page; consecutive
//   pages of a run too when the strides continue; HND slices of consecutive pages).
// Zero-byte copies are dropped. Never merges into pieces that overlap on the destination.
// Clears *out. Order of descs is the order of the first copy of each, so ExecuteOnCpu of the
// result writes exactly what memcpy of each copy in order writes.
void CoalesceCopies(std::span<const ResolvedCopy> copies, std::vector<CopyDesc>* out);

// The reference: memcpy of every piece, descriptor by descriptor, piece by piece.
void ExecuteOnCpu(std::span<const CopyDesc> descs);

// Sum of count * bytes.
uint64_t TotalBytes(std::span<const CopyDesc> descs);

// Checks the limits above; the message names the first descriptor that breaks one.
Status ValidateDescs(std::span<const CopyDesc> descs);

// The kernel's work list: descriptors with their vector width and tiling, and where each
// descriptor's tiles start in the flat tile space the grid walks. GatherCopier uploads exactly
// this (TiledDesc array, then tile_start).
struct TilePlan {
  std::vector<TiledDesc> descs;
  std::vector<uint64_t> tile_start;  // descs.size() + 1 entries; the last is the tile count
  uint64_t tiles() const { return tile_start.empty() ? 0 : tile_start.back(); }
};

// Validates `descs` (ValidateDescs) and plans their tiles of at most `tile_units` vectors each:
// the vector width is the largest of 16, 8, 4, 2, 1 bytes that divides src, dst, bytes and both
// strides; a piece of at least tile_units / 2 vectors is split into tiles, smaller pieces are
// grouped, tile_units / units_per_piece of them per tile. tile_units must be a power of two in
// [32, 65536]. Clears *out first.
Status PlanTiles(std::span<const CopyDesc> descs, uint32_t tile_units, TilePlan* out);

// Runs `plan` tile by tile through tile_map.h, exactly as the kernel maps its threads, with
// memcpy of each vector: the CPU check of the kernel's decomposition.
void ExecuteTilesOnCpu(const TilePlan& plan, uint32_t tile_units);

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_COPY_PLAN_H_
