// The address arithmetic of the gather kernel, shared by the kernel (gather_copy.cu, compiled
// by nvcc as host-device code) and the CPU check of it (ExecuteTilesOnCpu in copy_plan.cc), so
// that the tile decomposition the GPU runs is tested in every build, with or without a GPU.
//
// The grid walks a flat space of tiles. Each descriptor owns a contiguous range of tiles
// (TilePlan::tile_start); a tile is either one chunk of at most `tile_units` vectors of one
// large piece, or a group of whole small pieces (at most tile_units vectors in all). A vector is
// the widest unit (16, 8, 4, 2 or 1 bytes) that divides the descriptor's addresses, length and
// strides. Plain structs and inline functions; no allocation, no state.
#ifndef PDLIB_BACKENDS_CUDA_IPC_TILE_MAP_H_
#define PDLIB_BACKENDS_CUDA_IPC_TILE_MAP_H_

#include <cstdint>

#if defined(__CUDACC__)
#define PDLIB_CUDA_IPC_HD __host__ __device__
#else
#define PDLIB_CUDA_IPC_HD
#endif

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// One CopyDesc as the kernel reads it (PlanTiles fills these).
struct TiledDesc {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  uint64_t count = 0;            // pieces
  uint64_t units_per_piece = 0;  // piece bytes >> unit_shift
  uint64_t tiles_per_piece = 1;  // > 1: a piece is split into this many tiles
  uint32_t pieces_per_tile = 1;  // > 1: a tile holds this many whole pieces
  uint32_t unit_shift = 0;       // log2 of the vector width in bytes, 0..4
};

// The part of one descriptor that one tile copies: `pieces` pieces from `piece` on, vectors
// [unit_begin, unit_begin + units) of each; `total` = pieces * units vectors.
struct TileSpan {
  uint64_t piece = 0;
  uint64_t unit_begin = 0;
  uint32_t units = 0;
  uint32_t pieces = 0;
  uint32_t total = 0;
};

// The descriptor owning `tile`: the last d in [0, n) with tile_start[d] <= tile. Requires
// tile_start strictly increasing with tile_start[0] == 0 and tile < tile_start[n].
PDLIB_CUDA_IPC_HD inline uint32_t FindTileDesc(const uint64_t* tile_start, uint32_t n,
                                               uint64_t tile) {
  uint32_t lo = 0;
  uint32_t hi = n;  // tile_start[lo] <= tile < tile_start[hi]
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (tile_start[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Tile `local` (counted from the descriptor's first tile) of `d`.
PDLIB_CUDA_IPC_HD inline TileSpan TileOf(const TiledDesc& d, uint64_t local, uint32_t tile_units) {
  TileSpan s;
  if (d.pieces_per_tile > 1) {
    s.piece = local * d.pieces_per_tile;
    const uint64_t left = d.count - s.piece;
    s.pieces = left < d.pieces_per_tile ? static_cast<uint32_t>(left) : d.pieces_per_tile;
    s.units = static_cast<uint32_t>(d.units_per_piece);
  } else {
    s.piece = local / d.tiles_per_piece;
    s.unit_begin = (local - s.piece * d.tiles_per_piece) * tile_units;
    const uint64_t left = d.units_per_piece - s.unit_begin;
    s.units = left < tile_units ? static_cast<uint32_t>(left) : tile_units;
    s.pieces = 1;
  }
  s.total = s.pieces * s.units;
  return s;
}

// Byte addresses of vector `v` (< s.total) of the tile.
PDLIB_CUDA_IPC_HD inline void UnitAddress(const TiledDesc& d, const TileSpan& s, uint32_t v,
                                          uint64_t* src, uint64_t* dst) {
  const uint32_t p = s.pieces > 1 ? v / s.units : 0;
  const uint64_t piece = s.piece + p;
  const uint64_t unit = s.unit_begin + (v - p * s.units);
  *src = d.src + piece * d.src_stride + (unit << d.unit_shift);
  *dst = d.dst + piece * d.dst_stride + (unit << d.unit_shift);
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_TILE_MAP_H_
