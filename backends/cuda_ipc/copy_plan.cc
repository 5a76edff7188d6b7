// Coalescing and tiling of resolved copies; see copy_plan.h for the rules and limits.
#include "backends/cuda_ipc/copy_plan.h"

#include <cstring>
#include <limits>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

// base + i * stride, false when it does not fit in 64 bits.
bool Advance(uint64_t base, uint64_t i, uint64_t stride, uint64_t* out) {
  uint64_t step = 0;
  return !__builtin_mul_overflow(i, stride, &step) && !__builtin_add_overflow(base, step, out);
}

// Whether `c` continues `d` (the last descriptor so far); extends it when it does.
bool Extend(CopyDesc* d, const ResolvedCopy& c) {
  if (d->count == 1) {
    uint64_t src_end = 0;
    uint64_t dst_end = 0;
    uint64_t merged = 0;
    if (Advance(d->src, 1, d->bytes, &src_end) && Advance(d->dst, 1, d->bytes, &dst_end) &&
        c.src == src_end && c.dst == dst_end) {
      // Contiguous on both sides: one longer piece.
      if (__builtin_add_overflow(d->bytes, c.bytes, &merged)) return false;
      d->bytes = merged;
      return true;
    }
    // A second piece of the same length, forward on both sides, not overlapping the first on
    // the destination: the start of a strided run.
    if (c.bytes != d->bytes || c.src < d->src || c.dst < d->dst) return false;
    if (c.dst - d->dst < d->bytes) return false;
    d->src_stride = c.src - d->src;
    d->dst_stride = c.dst - d->dst;
    d->count = 2;
    return true;
  }
  if (c.bytes != d->bytes) return false;
  uint64_t src_next = 0;
  uint64_t dst_next = 0;
  if (!Advance(d->src, d->count, d->src_stride, &src_next) ||
      !Advance(d->dst, d->count, d->dst_stride, &dst_next)) {
    return false;
  }
  if (c.src != src_next || c.dst != dst_next) return false;
  ++d->count;
  return true;
}

// Whether the pieces of a side (first at `base`, `count` of `bytes`, `stride` apart) stay
// below 2^64.
bool SideFits(uint64_t base, uint64_t count, uint64_t stride, uint64_t bytes) {
  uint64_t last = 0;
  uint64_t end = 0;
  return Advance(base, count - 1, stride, &last) && !__builtin_add_overflow(last, bytes, &end);
}

uint32_t UnitShift(const CopyDesc& d) {
  uint64_t bits = d.src | d.dst | d.bytes;
  if (d.count > 1) bits |= d.src_stride | d.dst_stride;
  uint32_t shift = 4;
  while (shift > 0 && (bits & ((uint64_t{1} << shift) - 1)) != 0) --shift;
  return shift;
}

}  // namespace

void CoalesceCopies(std::span<const ResolvedCopy> copies, std::vector<CopyDesc>* out) {
  out->clear();
  for (const ResolvedCopy& c : copies) {
    if (c.bytes == 0) continue;
    if (!out->empty() && Extend(&out->back(), c)) continue;
    out->push_back(CopyDesc{c.src, c.dst, c.bytes, 1, 0, 0});
  }
}

void ExecuteOnCpu(std::span<const CopyDesc> descs) {
  for (const CopyDesc& d : descs) {
    for (uint64_t i = 0; i < d.count; ++i) {
      std::memcpy(reinterpret_cast<void*>(d.dst + i * d.dst_stride),
                  reinterpret_cast<const void*>(d.src + i * d.src_stride), d.bytes);
    }
  }
}

uint64_t TotalBytes(std::span<const CopyDesc> descs) {
  uint64_t total = 0;
  for (const CopyDesc& d : descs) total += d.count * d.bytes;
  return total;
}

Status ValidateDescs(std::span<const CopyDesc> descs) {
  for (size_t i = 0; i < descs.size(); ++i) {
    const CopyDesc& d = descs[i];
    const std::string where =
        "copy descriptor " + std::to_string(i) + " of " + std::to_string(descs.size()) + ": ";
    if (d.bytes == 0 || d.count == 0) {
      return Status::InvalidArgument(where + "bytes " + std::to_string(d.bytes) + " and count " +
                                     std::to_string(d.count) + " must both be at least 1");
    }
    if (!SideFits(d.src, d.count, d.src_stride, d.bytes) ||
        !SideFits(d.dst, d.count, d.dst_stride, d.bytes)) {
      return Status::InvalidArgument(where + std::to_string(d.count) + " pieces of " +
                                     std::to_string(d.bytes) +
                                     " bytes run past the end of the address space");
    }
    if (d.count > 1 && d.dst_stride < d.bytes) {
      return Status::InvalidArgument(where + "destination stride " + std::to_string(d.dst_stride) +
                                     " is below the piece length " + std::to_string(d.bytes) +
                                     ": pieces would overlap");
    }
  }
  return Status::OK();
}

Status PlanTiles(std::span<const CopyDesc> descs, uint32_t tile_units, TilePlan* out) {
  out->descs.clear();
  out->tile_start.clear();
  if (tile_units < 32 || tile_units > 65536 || (tile_units & (tile_units - 1)) != 0) {
    return Status::InvalidArgument("tile_units " + std::to_string(tile_units) +
                                   " must be a power of two in [32, 65536]");
  }
  if (descs.size() >= std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(std::to_string(descs.size()) +
                                   " copy descriptors in one batch; at most 2^32 - 2");
  }
  if (Status s = ValidateDescs(descs); !s.ok()) return s;
  out->descs.reserve(descs.size());
  out->tile_start.reserve(descs.size() + 1);
  uint64_t next = 0;
  out->tile_start.push_back(0);
  for (const CopyDesc& d : descs) {
    TiledDesc t;
    t.src = d.src;
    t.dst = d.dst;
    t.count = d.count;
    t.src_stride = d.count > 1 ? d.src_stride : 0;
    t.dst_stride = d.count > 1 ? d.dst_stride : 0;
    t.unit_shift = UnitShift(d);
    t.units_per_piece = d.bytes >> t.unit_shift;
    uint64_t tiles = 0;
    if (t.units_per_piece >= tile_units / 2) {
      t.tiles_per_piece = (t.units_per_piece + tile_units - 1) / tile_units;
      t.pieces_per_tile = 1;
      if (__builtin_mul_overflow(t.count, t.tiles_per_piece, &tiles)) tiles = 0;
    } else {
      t.tiles_per_piece = 1;
      t.pieces_per_tile = static_cast<uint32_t>(tile_units / t.units_per_piece);
      tiles = (t.count + t.pieces_per_tile - 1) / t.pieces_per_tile;
    }
    if (tiles == 0 || __builtin_add_overflow(next, tiles, &next)) {
      out->descs.clear();
      out->tile_start.clear();
      return Status::InvalidArgument("copy batch has more than 2^64 tiles");
    }
    out->descs.push_back(t);
    out->tile_start.push_back(next);
  }
  return Status::OK();
}

void ExecuteTilesOnCpu(const TilePlan& plan, uint32_t tile_units) {
  const uint32_t n = static_cast<uint32_t>(plan.descs.size());
  for (uint64_t tile = 0; tile < plan.tiles(); ++tile) {
    const uint32_t i = FindTileDesc(plan.tile_start.data(), n, tile);
    const TiledDesc& d = plan.descs[i];
    const TileSpan span = TileOf(d, tile - plan.tile_start[i], tile_units);
    for (uint32_t v = 0; v < span.total; ++v) {
      uint64_t src = 0;
      uint64_t dst = 0;
      UnitAddress(d, span, v, &src, &dst);
      std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                  size_t{1} << d.unit_shift);
    }
  }
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
