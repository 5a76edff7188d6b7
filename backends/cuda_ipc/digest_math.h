// The arithmetic of the GPU digest kernel (digest_kernel.cu), on the host and on the device
// alike, so that the tests check the kernel's decomposition on a machine without a GPU
// (test/cuda_ipc/digest_math_test.cc) and the GPU test only has to show that the device runs it.
//
// What the kernel computes: for each piece (spi::DigestRange: an address, a length, a count of
// zero bytes after it), the raw CRC32C of its bytes followed by the zeros (lib/base/crc32c.h:
// zero initial register, no final inversion). The raw CRC is linear over GF(2) and appending n
// zero bytes multiplies it by x^(8n) modulo the polynomial, so a piece splits into independent
// parts: piece = tiles of kDigestTileBytes (one per thread block), tile = segments of
// kDigestSegmentBytes (one per thread). With L the tile's length, Lf = L rounded down to a
// whole segment and r = L - Lf:
//   raw(tile) = MulMod(XOR over full segments t of MulMod(raw(seg t), F64[Lf/64 - t - 1]),
//                      x^(8r)) XOR raw(the partial segment [Lf, L))
//   out[piece] = XOR over its tiles of MulMod(raw(tile), x^(8 (bytes after the tile + zeros)))
// F64[k] = x^(8 * 64 k) (DigestSegmentFactors), x^(8n) for other n by square and multiply over
// DigestPowerTable (x^(8 * 2^i)).
#ifndef PDLIB_BACKENDS_CUDA_IPC_DIGEST_MATH_H_
#define PDLIB_BACKENDS_CUDA_IPC_DIGEST_MATH_H_

#include <cstdint>

#if defined(__CUDACC__)
#define PDLIB_DIGEST_HD __host__ __device__ __forceinline__
#else
#define PDLIB_DIGEST_HD inline
#endif

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

inline constexpr uint32_t kDigestPoly = 0x82F63B78u;  // CRC32C, reflected
inline constexpr uint32_t kDigestThreads = 256;
inline constexpr uint32_t kDigestSegmentBytes = 64;
inline constexpr uint32_t kDigestTileBytes = kDigestThreads * kDigestSegmentBytes;  // 16 KiB
inline constexpr uint32_t kDigestPowers = 64;  // x^(8 * 2^i), i < 64: any 64-bit byte count

// The tables the kernel reads (constant memory on the device; DigestTables() on the host).
struct DigestTables {
  uint32_t bytes[4][256];                 // slicing by four: t[k][i] = i followed by k zeros
  uint32_t segments[kDigestThreads + 1];  // F64[k] = x^(8 * kDigestSegmentBytes * k)
  uint32_t powers[kDigestPowers];         // x^(8 * 2^i)
};

// a * b modulo the polynomial, bit-reflected (bit 31 is x^0), as lib/base's Crc32cMulMod.
PDLIB_DIGEST_HD uint32_t DigestMulMod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kDigestPoly : b >> 1;
  }
  return product;
}

// x^(8 * bytes) from the power table.
PDLIB_DIGEST_HD uint32_t DigestZerosFactor(const DigestTables& t, uint64_t bytes) {
  uint32_t result = 0x80000000u;  // x^0
  for (int i = 0; bytes != 0 && i < static_cast<int>(kDigestPowers); ++i, bytes >>= 1) {
    if (bytes & 1) result = DigestMulMod(result, t.powers[i]);
  }
  return result;
}

// Continues the raw CRC over one byte, and over one little-endian 32-bit word.
PDLIB_DIGEST_HD uint32_t DigestByte(const DigestTables& t, uint32_t crc, uint8_t b) {
  return (crc >> 8) ^ t.bytes[0][(crc ^ b) & 0xff];
}
PDLIB_DIGEST_HD uint32_t DigestWord(const DigestTables& t, uint32_t crc, uint32_t w) {
  const uint32_t x = crc ^ w;
  return t.bytes[3][x & 0xff] ^ t.bytes[2][(x >> 8) & 0xff] ^ t.bytes[1][(x >> 16) & 0xff] ^
         t.bytes[0][x >> 24];
}

// One thread's part of a tile of `tile_len` bytes: segment `t` is [64 t, min(64 (t + 1), L)).
// Returns whether the segment is full (its CRC goes into the shifted XOR) and sets its bounds.
PDLIB_DIGEST_HD bool DigestSegment(uint32_t tile_len, uint32_t t, uint32_t* begin, uint32_t* end) {
  *begin = t * kDigestSegmentBytes;
  if (*begin >= tile_len) {
    *end = *begin;
    return false;
  }
  *end = tile_len - *begin < kDigestSegmentBytes ? tile_len : *begin + kDigestSegmentBytes;
  return *end - *begin == kDigestSegmentBytes;
}

// A full segment's CRC as it enters the tile's XOR: shifted past the full segments after it.
PDLIB_DIGEST_HD uint32_t DigestFullSegmentTerm(const DigestTables& t, uint32_t crc,
                                               uint32_t tile_len, uint32_t segment) {
  const uint32_t full = tile_len / kDigestSegmentBytes;
  return DigestMulMod(crc, t.segments[full - segment - 1]);
}

// The tile's raw CRC from the XOR of its full segments' terms and the partial segment's raw CRC.
PDLIB_DIGEST_HD uint32_t DigestTileCrc(const DigestTables& t, uint32_t full_xor,
                                       uint32_t partial_crc, uint32_t tile_len) {
  const uint32_t r = tile_len % kDigestSegmentBytes;
  return (r == 0 ? full_xor : DigestMulMod(full_xor, DigestZerosFactor(t, r))) ^ partial_crc;
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_DIGEST_MATH_H_
