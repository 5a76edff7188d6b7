#include "backends/cuda_ipc/digest_plan.h"

#include <algorithm>

#include "lib/base/crc32c.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

const DigestTables& HostDigestTables() {
  static const DigestTables* tables = [] {
    auto* t = new DigestTables();
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kDigestPoly : c >> 1;
      t->bytes[0][i] = c;
    }
    for (int k = 1; k < 4; ++k) {
      for (uint32_t i = 0; i < 256; ++i) {
        t->bytes[k][i] = (t->bytes[k - 1][i] >> 8) ^ t->bytes[0][t->bytes[k - 1][i] & 0xff];
      }
    }
    for (uint32_t k = 0; k <= kDigestThreads; ++k) {
      t->segments[k] = Crc32cZerosFactor(uint64_t{kDigestSegmentBytes} * k);
    }
    for (uint32_t i = 0; i < kDigestPowers; ++i) {
      // x^(8 * 2^i): squaring x^(8 * 2^(i - 1)).
      t->powers[i] =
          i == 0 ? Crc32cZerosFactor(1) : Crc32cMulMod(t->powers[i - 1], t->powers[i - 1]);
    }
    return t;
  }();
  return *tables;
}

std::vector<DigestTile> PlanDigestTiles(std::span<const spi::DigestRange> ranges) {
  std::vector<DigestTile> tiles;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const spi::DigestRange& range = ranges[r];
    for (uint64_t at = 0; at < range.length; at += kDigestTileBytes) {
      const uint64_t n = std::min<uint64_t>(kDigestTileBytes, range.length - at);
      tiles.push_back({range.addr + at, range.length - at - n + range.zeros_after,
                       static_cast<uint32_t>(n), static_cast<uint32_t>(r)});
    }
  }
  return tiles;
}

void DigestTilesOnCpu(std::span<const DigestTile> tiles, std::span<uint32_t> crcs) {
  const DigestTables& t = HostDigestTables();
  for (uint32_t& c : crcs) c = 0;
  for (const DigestTile& tile : tiles) {
    uint32_t full_xor = 0;
    uint32_t partial = 0;
    for (uint32_t thread = 0; thread < kDigestThreads; ++thread) {
      uint32_t begin = 0, end = 0;
      const bool full = DigestSegment(tile.length, thread, &begin, &end);
      const auto* p = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(tile.addr));
      uint32_t crc = 0;
      uint32_t i = begin;
      if (full && (tile.addr + begin) % 4 == 0) {
        for (; i + 4 <= end; i += 4) {
          const uint32_t w = uint32_t{p[i]} | uint32_t{p[i + 1]} << 8 | uint32_t{p[i + 2]} << 16 |
                             uint32_t{p[i + 3]} << 24;
          crc = DigestWord(t, crc, w);
        }
      }
      for (; i < end; ++i) crc = DigestByte(t, crc, p[i]);
      if (full) {
        full_xor ^= DigestFullSegmentTerm(t, crc, tile.length, thread);
      } else if (begin < end) {
        partial = crc;
      }
    }
    const uint32_t tile_crc = DigestTileCrc(t, full_xor, partial, tile.length);
    crcs[tile.range] ^= DigestMulMod(tile_crc, DigestZerosFactor(t, tile.after));
  }
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
