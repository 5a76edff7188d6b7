// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) in its raw form, the building block of
// pdlib's KV integrity digest (lib/core/kv_digest.h).
//
// Raw: the register starts at the value given (0 for a fresh message) and is not inverted at the
// end. With a zero start the raw CRC is linear over GF(2): for messages A, B of equal length,
// Raw(A xor B) = Raw(A) xor Raw(B). So the raw CRC of a page that several writers fill, each its
// own byte ranges, is the XOR of what each writer computes over its ranges with zeros elsewhere
// (Crc32cShift skips the zeros without reading them), and decode's CRC of the whole page as it
// landed must equal that XOR.
//
// Speed, chosen at run time: on x86-64 with AVX-512 and VPCLMULQDQ, folding 256 bytes a round
// with carry-less multiplications (16 lanes of 128 bits) for buffers of 256 bytes and more;
// otherwise SSE4.2's crc32 instruction (x86-64) or ARMv8's CRC32C instructions over three
// independent streams at once for long buffers (the instruction's latency is three cycles, its
// throughput one per cycle), the streams joined with precomputed shift tables; a table-driven
// software path (slicing by eight) elsewhere.
#ifndef PDLIB_LIB_BASE_CRC32C_H_
#define PDLIB_LIB_BASE_CRC32C_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace pdlib {
inline namespace v1 {

// The raw CRC32C of `data[0, n)` continued from register value `crc`.
uint32_t Crc32cRaw(uint32_t crc, const void* data, size_t n);
// Copies n bytes from src to dst (which must not overlap) and returns the raw CRC32C of them
// continued from `crc`: one pass where the CRC path is the AVX-512 fold (each 64 bytes loaded
// once, stored and folded), else memcpy and then Crc32cRaw over src.
uint32_t Crc32cCopy(uint32_t crc, void* dst, const void* src, size_t n);
// Crc32cRaw by the portable table-driven path whatever the CPU has (tests compare the two).
uint32_t Crc32cRawPortable(uint32_t crc, const void* data, size_t n);
// Which path Crc32cRaw takes here: "avx512-vpclmul", "sse4.2", "armv8-crc" or "portable".
const char* Crc32cImplementation();
// Every path this CPU can run, fastest first (Crc32cRaw takes the first), and the CRC by one of
// them (nullopt for a path not in that list): tests and benchmarks compare them.
std::vector<std::string_view> Crc32cPaths();
std::optional<uint32_t> Crc32cRawBy(std::string_view path, uint32_t crc, const void* data,
                                    size_t n);

// a * b modulo the CRC32C polynomial, both in the CRC's bit-reflected representation (bit 31 is
// the coefficient of x^0).
// One carry-less multiplication and a crc32 instruction where the CPU has them (x86-64 PCLMUL and
// SSE4.2), the bitwise definition elsewhere; Crc32cMulModPortable is always the bitwise one.
uint32_t Crc32cMulMod(uint32_t a, uint32_t b);
uint32_t Crc32cMulModPortable(uint32_t a, uint32_t b);
// x^(8 * bytes) modulo the polynomial: what appending `bytes` zero bytes multiplies a raw CRC by.
uint32_t Crc32cZerosFactor(uint64_t bytes);

// crc followed by `bytes` zero bytes, by Crc32cShift tables built once per length and cached per
// thread (at most 256 lengths, then the cache starts over): for the few lengths a KV layout has.
uint32_t Crc32cAppendZeros(uint32_t crc, uint64_t bytes);

// Appending a fixed number of zero bytes to a message, applied to its raw CRC in four table
// lookups (the map is linear in the CRC). Build once per length (1024 multiplications), use many
// times; 4 KiB.
class Crc32cShift {
 public:
  explicit Crc32cShift(uint64_t bytes = 0);
  uint64_t bytes() const { return bytes_; }
  uint32_t operator()(uint32_t crc) const {
    return table_[0][crc & 0xff] ^ table_[1][(crc >> 8) & 0xff] ^ table_[2][(crc >> 16) & 0xff] ^
           table_[3][crc >> 24];
  }

 private:
  uint64_t bytes_ = 0;
  std::array<std::array<uint32_t, 256>, 4> table_{};
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_BASE_CRC32C_H_
