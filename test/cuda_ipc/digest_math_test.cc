// The GPU digest kernel's arithmetic (digest_math.h), its tables and its tiling (digest_plan.h),
// run on the CPU in the kernel's own decomposition (DigestTilesOnCpu: thread by thread, block by
// block) and compared with lib/base's CRC32C, which the host side of pdlib's KV digest uses. A
// wrong table, shift or segment boundary shows here, on a machine without a GPU.
#include "backends/cuda_ipc/digest_math.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cuda_ipc/digest_plan.h"
#include "lib/base/crc32c.h"
#include "test/cuda_ipc/copy_batches.h"

namespace pdlib::cuda_ipc {
namespace {

using testing::RandomBytes;

// What the host side of the digest computes for a range: lib/base's CRC32C.
uint32_t Reference(const uint8_t* p, uint64_t n, uint64_t zeros) {
  return Crc32cMulMod(Crc32cRaw(0, p, n), Crc32cZerosFactor(zeros));
}

uint64_t Addr(const uint8_t* p) { return reinterpret_cast<uint64_t>(p); }

TEST_CASE("digest tables: bytes, segment factors and powers match lib/base's CRC32C") {
  const DigestTables& t = HostDigestTables();
  std::mt19937_64 rng(1);
  const std::vector<uint8_t> data = RandomBytes(rng, 4096);
  uint32_t by_byte = 0, by_word = 0;
  for (uint8_t b : data) by_byte = DigestByte(t, by_byte, b);
  for (size_t i = 0; i < data.size(); i += 4) {
    uint32_t w = 0;
    std::memcpy(&w, &data[i], 4);
    by_word = DigestWord(t, by_word, w);
  }
  CHECK(by_byte == Crc32cRawPortable(0, data.data(), data.size()));
  CHECK(by_word == by_byte);
  for (uint32_t k = 0; k <= kDigestThreads; k += 17) {
    CHECK(t.segments[k] == Crc32cZerosFactor(uint64_t{kDigestSegmentBytes} * k));
  }
  for (uint32_t i = 0; i < 40; ++i) CHECK(t.powers[i] == Crc32cZerosFactor(uint64_t{1} << i));
}

TEST_CASE("digest arithmetic: multiplication and zero shifts as lib/base computes them") {
  const DigestTables& t = HostDigestTables();
  std::mt19937_64 rng(2);
  for (int i = 0; i < 2000; ++i) {
    const auto a = static_cast<uint32_t>(rng());
    const auto b = static_cast<uint32_t>(rng());
    REQUIRE(DigestMulMod(a, b) == Crc32cMulMod(a, b));
    // Every magnitude up to 2^61 bytes (lib/base counts bits in 64 bits).
    const uint64_t n = rng() >> (3 + rng() % 61);
    REQUIRE(DigestZerosFactor(t, n) == Crc32cZerosFactor(n));
  }
  CHECK(DigestZerosFactor(t, 0) == 0x80000000u);
}

TEST_CASE("digest segments: 256 threads cover a tile exactly once, one partial at most") {
  for (uint32_t len : {1u, 63u, 64u, 65u, 1000u, 4096u, kDigestTileBytes - 1, kDigestTileBytes}) {
    INFO("tile of " << len << " bytes");
    uint64_t covered = 0;
    int partials = 0;
    uint32_t next = 0;
    for (uint32_t thread = 0; thread < kDigestThreads; ++thread) {
      uint32_t begin = 0, end = 0;
      const bool full = DigestSegment(len, thread, &begin, &end);
      if (begin >= end) continue;
      CHECK(begin == next);
      next = end;
      covered += end - begin;
      CHECK(full == (end - begin == kDigestSegmentBytes));
      partials += full ? 0 : 1;
    }
    CHECK(covered == len);
    CHECK(partials == (len % kDigestSegmentBytes != 0 ? 1 : 0));
  }
}

TEST_CASE("digest tiles: ranges split into 16 KiB tiles with the bytes after each") {
  std::vector<uint8_t> buf(3 * kDigestTileBytes);
  const uint64_t base = Addr(buf.data());
  const std::vector<spi::DigestRange> ranges = {
      {base, 2 * kDigestTileBytes + 100, 7}, {base + 5, 0, 9}, {base + 3, 10, 0}};
  const std::vector<DigestTile> tiles = PlanDigestTiles(ranges);
  REQUIRE(tiles.size() == 4);
  CHECK(tiles[0].addr == base);
  CHECK(tiles[0].length == kDigestTileBytes);
  CHECK(tiles[0].after == kDigestTileBytes + 100 + 7);
  CHECK(tiles[1].after == 100 + 7);
  CHECK(tiles[2].length == 100);
  CHECK(tiles[2].after == 7);
  CHECK(tiles[2].range == 0);
  CHECK(tiles[3].range == 2);  // the empty range has no tile
  CHECK(tiles[3].addr == base + 3);
  CHECK(tiles[3].after == 0);
}

TEST_CASE("the kernel's decomposition on the CPU equals CRC32C for any length, alignment, zeros") {
  std::mt19937_64 rng(3);
  const std::vector<uint8_t> data = RandomBytes(rng, 200000);
  for (int round = 0; round < 30; ++round) {
    INFO("round " << round);
    std::vector<spi::DigestRange> ranges;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      // Whole 32 KiB items, head slices, odd lengths and offsets, empty ones.
      uint64_t len = 0;
      switch (rng() % 4) {
        case 0: len = 32768; break;
        case 1: len = 256 * (1 + rng() % 64); break;
        case 2: len = rng() % 70000; break;
        default: len = rng() % 130; break;
      }
      const uint64_t off = (rng() % 2 == 0 ? 0 : rng() % 16) + 64 * (rng() % 200);
      const uint64_t zeros = rng() % 3 == 0 ? 0 : rng() % 100000;
      ranges.push_back(
          {Addr(data.data()) + off, std::min<uint64_t>(len, data.size() - off), zeros});
    }
    std::vector<uint32_t> got(ranges.size(), 0xdeadbeef);
    DigestTilesOnCpu(PlanDigestTiles(ranges), got);
    for (size_t i = 0; i < ranges.size(); ++i) {
      INFO("range " << i << ": " << ranges[i].length << " bytes at +"
                    << (ranges[i].addr - Addr(data.data())) << ", " << ranges[i].zeros_after
                    << " zeros after");
      CHECK(got[i] == Reference(data.data() + (ranges[i].addr - Addr(data.data())),
                                ranges[i].length, ranges[i].zeros_after));
    }
  }
}

TEST_CASE("the decomposition is linear: a page's head slices XOR to the whole page") {
  // What M:N TP relies on: each sender's slices with zeros elsewhere, XORed, give decode's pass
  // over the whole page.
  std::mt19937_64 rng(4);
  const std::vector<uint8_t> page = RandomBytes(rng, 32768);
  const uint64_t base = Addr(page.data());
  std::vector<spi::DigestRange> slices;
  for (uint64_t at = 0; at < page.size(); at += 4096) {
    slices.push_back({base + at, 4096, page.size() - at - 4096});
  }
  std::vector<uint32_t> parts(slices.size());
  DigestTilesOnCpu(PlanDigestTiles(slices), parts);
  uint32_t x = 0;
  for (uint32_t p : parts) x ^= p;
  std::vector<uint32_t> whole(1);
  const std::vector<spi::DigestRange> one = {{base, page.size(), 0}};
  DigestTilesOnCpu(PlanDigestTiles(one), whole);
  CHECK(x == whole[0]);
  CHECK(whole[0] == Crc32cRaw(0, page.data(), page.size()));
  // And a flipped bit anywhere changes it.
  std::vector<uint8_t> bad = page;
  bad[12345] ^= 0x10;
  const std::vector<spi::DigestRange> other = {{Addr(bad.data()), bad.size(), 0}};
  DigestTilesOnCpu(PlanDigestTiles(other), whole);
  CHECK(whole[0] != x);
}

}  // namespace
}  // namespace pdlib::cuda_ipc
