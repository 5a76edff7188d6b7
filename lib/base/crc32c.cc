#include "lib/base/crc32c.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#if defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif
#endif

namespace pdlib {
inline namespace v1 {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + ... reflected, without the x^32 term

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
    }
  }
};

const Tables& SoftTables() {
  static const Tables* tables = new Tables();
  return *tables;
}

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;  // little-endian hosts only (x86-64, aarch64 Linux)
}

uint32_t Portable(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& tb = SoftTables();
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xff];
    --n;
  }
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t x = Load64(p) ^ crc;
    crc = tb.t[7][x & 0xff] ^ tb.t[6][(x >> 8) & 0xff] ^ tb.t[5][(x >> 16) & 0xff] ^
          tb.t[4][(x >> 24) & 0xff] ^ tb.t[3][(x >> 32) & 0xff] ^ tb.t[2][(x >> 40) & 0xff] ^
          tb.t[1][(x >> 48) & 0xff] ^ tb.t[0][x >> 56];
  }
  while (n-- > 0) crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xff];
  return crc;
}

// Three streams of kBlock bytes each, joined: Raw(A B C) = shift(Raw(A), 2 kBlock) ^
// shift(Raw(B), kBlock) ^ Raw(C), B and C started from 0 (linearity).
template <size_t kBlock>
struct Joiners {
  Crc32cShift one{kBlock}, two{2 * kBlock};
};
template <size_t kBlock>
const Joiners<kBlock>& JoinersFor() {
  static const Joiners<kBlock>* j = new Joiners<kBlock>();
  return *j;
}

#if defined(__x86_64__)
// x^e modulo the polynomial, reflected (bit 31 is x^0), by squaring from x^1.
uint32_t XPow(uint64_t e) {
  uint32_t result = 1u << 31, power = 1u << 30;
  for (; e != 0; e >>= 1) {
    if (e & 1) result = Crc32cMulMod(result, power);
    power = Crc32cMulMod(power, power);
  }
  return result;
}

// Folding with carry-less multiplication (the method of Intel's "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ", worked out here for the reflected CRC32C). A 128-bit
// lane loaded little-endian holds 16 message bytes as a polynomial whose bit j is the coefficient
// of x^(127-j); its low qword L and high qword H give lane = L x^64 + H. Moving the lane D bits
// further on is lane x^D = L x^(64+D) + H x^D; a carry-less product of two reflected qwords is
// their polynomial product times x^-1 read in a 128-bit lane, so multiplying L by
// K_lo = x^(D+63) mod P and H by K_hi = x^(D-1) mod P (32-bit remainders, placed in the top half
// of each qword) gives a 96-bit lane congruent to lane x^D, which is XORed onto the lane D bits
// later. Once one lane is left, its CRC (the raw CRC of its 16 bytes from 0, two crc32
// instructions) is the CRC of everything folded into it.
struct FoldConstants {
  uint64_t k2048[2], k512[2], k384[2], k256[2], k128[2];
  FoldConstants() {
    Set(2048, k2048);
    Set(512, k512);
    Set(384, k384);
    Set(256, k256);
    Set(128, k128);
  }
  static void Set(uint64_t d, uint64_t* k) {
    k[0] = static_cast<uint64_t>(XPow(d + 63)) << 32;
    k[1] = static_cast<uint64_t>(XPow(d - 1)) << 32;
  }
};
const FoldConstants& Folds() {
  static const FoldConstants* k = new FoldConstants();
  return *k;
}

#define PDLIB_CRC_FOLD_TARGET \
  __attribute__((target("sse4.2,pclmul,avx512f,avx512vl,avx512bw,vpclmulqdq")))

PDLIB_CRC_FOLD_TARGET inline __m512i Fold512(__m512i x, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

PDLIB_CRC_FOLD_TARGET inline __m512i Broadcast(const uint64_t* k) {
  return _mm512_set_epi64(static_cast<int64_t>(k[1]), static_cast<int64_t>(k[0]),
                          static_cast<int64_t>(k[1]), static_cast<int64_t>(k[0]),
                          static_cast<int64_t>(k[1]), static_cast<int64_t>(k[0]),
                          static_cast<int64_t>(k[1]), static_cast<int64_t>(k[0]));
}

PDLIB_CRC_FOLD_TARGET inline __m512i Load512(const uint8_t* at) { return _mm512_loadu_si512(at); }

PDLIB_CRC_FOLD_TARGET inline __m128i Fold128(__m128i x, const uint64_t* k, __m128i next) {
  const __m128i kk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k));
  return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(x, kk, 0x00),
                                _mm_clmulepi64_si128(x, kk, 0x11), next, 0x96);
}

__attribute__((target("sse4.2"))) uint32_t Sse42(uint32_t crc, const uint8_t* p, size_t n);

// AVX-512 with VPCLMULQDQ: four 64-byte accumulators (256 bytes a round), four lanes each.
// Loads 64 bytes at p and, when copying, stores them at q.
template <bool kCopy>
PDLIB_CRC_FOLD_TARGET inline __m512i Take512(const uint8_t* p, uint8_t* q) {
  const __m512i v = _mm512_loadu_si512(p);
  if constexpr (kCopy) _mm512_storeu_si512(q, v);
  return v;
}

// AVX-512 with VPCLMULQDQ: four 64-byte accumulators (256 bytes a round), four lanes each. With
// kCopy the bytes also go to q as they are loaded (Crc32cCopy: one pass for both).
template <bool kCopy>
PDLIB_CRC_FOLD_TARGET uint32_t Avx512FoldImpl(uint32_t crc, const uint8_t* p, size_t n,
                                              uint8_t* q) {
  if (n < 256) {
    if constexpr (kCopy) std::memcpy(q, p, n);
    return Sse42(crc, p, n);
  }
  const FoldConstants& f = Folds();
  // The register continues the CRC: XORed onto the message's first 32 bits.
  __m512i a0 = _mm512_xor_si512(Take512<kCopy>(p, q),
                                _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i a1 = Take512<kCopy>(p + 64, q + 64), a2 = Take512<kCopy>(p + 128, q + 128),
          a3 = Take512<kCopy>(p + 192, q + 192);
  p += 256;
  q += kCopy ? 256 : 0;
  n -= 256;
  const __m512i k2048 = Broadcast(f.k2048);
  for (; n >= 256; n -= 256, p += 256, q += kCopy ? 256 : 0) {
    a0 = Fold512(a0, k2048, Take512<kCopy>(p, q));
    a1 = Fold512(a1, k2048, Take512<kCopy>(p + 64, q + 64));
    a2 = Fold512(a2, k2048, Take512<kCopy>(p + 128, q + 128));
    a3 = Fold512(a3, k2048, Take512<kCopy>(p + 192, q + 192));
  }
  const __m512i k512 = Broadcast(f.k512);
  __m512i a = Fold512(a0, k512, a1);
  a = Fold512(a, k512, a2);
  a = Fold512(a, k512, a3);
  for (; n >= 64; n -= 64, p += 64, q += kCopy ? 64 : 0) {
    a = Fold512(a, k512, Take512<kCopy>(p, q));
  }
  // The four lanes into one: lane i is 16 (3 - i) bytes before the last.
  alignas(64) uint8_t lanes[64];
  _mm512_store_si512(lanes, a);
  auto lane = [&lanes](int i) {
    return _mm_load_si128(reinterpret_cast<const __m128i*>(lanes + 16 * i));
  };
  __m128i r = Fold128(lane(2), f.k128, lane(3));
  r = Fold128(lane(1), f.k256, r);
  r = Fold128(lane(0), f.k384, r);
  for (; n >= 16; n -= 16, p += 16, q += kCopy ? 16 : 0) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kCopy) _mm_storeu_si128(reinterpret_cast<__m128i*>(q), v);
    r = Fold128(r, f.k128, v);
  }
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(r)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(r, 1)));
  if constexpr (kCopy) std::memcpy(q, p, n);
  return Sse42(static_cast<uint32_t>(c), p, n);
}

uint32_t Avx512Fold(uint32_t crc, const uint8_t* p, size_t n) {
  return Avx512FoldImpl<false>(crc, p, n, nullptr);
}
uint32_t Avx512FoldCopy(uint32_t crc, const uint8_t* p, size_t n, uint8_t* q) {
  return Avx512FoldImpl<true>(crc, p, n, q);
}

template <size_t kBlock>
__attribute__((target("sse4.2"))) uint32_t ThreeStreams(uint32_t crc, const uint8_t*& p,
                                                        size_t& n) {
  const Joiners<kBlock>& j = JoinersFor<kBlock>();
  while (n >= 3 * kBlock) {
    uint64_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      a = _mm_crc32_u64(a, Load64(p + i));
      b = _mm_crc32_u64(b, Load64(p + kBlock + i));
      c = _mm_crc32_u64(c, Load64(p + 2 * kBlock + i));
    }
    crc = j.two(static_cast<uint32_t>(a)) ^ j.one(static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t Sse42(uint32_t crc, const uint8_t* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  crc = ThreeStreams<4096>(crc, p, n);
  crc = ThreeStreams<256>(crc, p, n);
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, Load64(p));
  crc = static_cast<uint32_t>(c);
  while (n-- > 0) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}
#elif defined(__aarch64__)
template <size_t kBlock>
__attribute__((target("+crc"))) uint32_t ThreeStreams(uint32_t crc, const uint8_t*& p, size_t& n) {
  const Joiners<kBlock>& j = JoinersFor<kBlock>();
  while (n >= 3 * kBlock) {
    uint32_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      a = __crc32cd(a, Load64(p + i));
      b = __crc32cd(b, Load64(p + kBlock + i));
      c = __crc32cd(c, Load64(p + 2 * kBlock + i));
    }
    crc = j.two(a) ^ j.one(b) ^ c;
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return crc;
}

__attribute__((target("+crc"))) uint32_t Armv8(uint32_t crc, const uint8_t* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    crc = __crc32cb(crc, *p++);
    --n;
  }
  crc = ThreeStreams<4096>(crc, p, n);
  crc = ThreeStreams<256>(crc, p, n);
  for (; n >= 8; n -= 8, p += 8) crc = __crc32cd(crc, Load64(p));
  while (n-- > 0) crc = __crc32cb(crc, *p++);
  return crc;
}
#endif

using Impl = uint32_t (*)(uint32_t, const uint8_t*, size_t);
struct Path {
  const char* name;
  Impl fn;
};
// The paths this CPU can run, fastest first.
struct Chosen {
  std::vector<Path> paths;
  Chosen() {
#if defined(__x86_64__)
    const bool sse42 = __builtin_cpu_supports("sse4.2");
    if (sse42 && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("vpclmulqdq")) {
      paths.push_back({"avx512-vpclmul", Avx512Fold});
    }
    if (sse42) paths.push_back({"sse4.2", Sse42});
#elif defined(__aarch64__) && defined(__linux__)
    if (getauxval(AT_HWCAP) & HWCAP_CRC32) paths.push_back({"armv8-crc", Armv8});
#endif
    paths.push_back({"portable", Portable});
    // PDLIB_CRC32C names the path to prefer (benchmarks compare them in one binary); a path this
    // CPU cannot run is ignored.
    if (const char* want = std::getenv("PDLIB_CRC32C"); want != nullptr) {
      for (size_t i = 0; i < paths.size(); ++i) {
        if (std::string_view(want) == paths[i].name) std::swap(paths[0], paths[i]);
      }
    }
  }
};
const Chosen& Choice() {
  static const Chosen* chosen = new Chosen();
  return *chosen;
}
}  // namespace

uint32_t Crc32cRaw(uint32_t crc, const void* data, size_t n) {
  static const Impl fastest = Choice().paths.front().fn;
  return fastest(crc, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32cCopy(uint32_t crc, void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  static const bool fused = Choice().paths.front().fn == Avx512Fold;
  if (fused) {
    return Avx512FoldCopy(crc, static_cast<const uint8_t*>(src), n, static_cast<uint8_t*>(dst));
  }
#endif
  // Elsewhere: the copy, then the CRC of the source (still in cache).
  std::memcpy(dst, src, n);
  return Crc32cRaw(crc, src, n);
}

uint32_t Crc32cRawPortable(uint32_t crc, const void* data, size_t n) {
  return Portable(crc, static_cast<const uint8_t*>(data), n);
}

const char* Crc32cImplementation() { return Choice().paths.front().name; }

std::vector<std::string_view> Crc32cPaths() {
  std::vector<std::string_view> names;
  for (const Path& p : Choice().paths) names.emplace_back(p.name);
  return names;
}

std::optional<uint32_t> Crc32cRawBy(std::string_view path, uint32_t crc, const void* data,
                                    size_t n) {
  for (const Path& p : Choice().paths) {
    if (path == p.name) return p.fn(crc, static_cast<const uint8_t*>(data), n);
  }
  return std::nullopt;
}

namespace {

uint32_t MulModBitwise(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b * x
  }
  return product;
}

#if defined(__x86_64__)
// One carry-less multiplication and one crc32 instruction. The product c of two reflected 32-bit
// values has bit k as the coefficient of x^(62-k); shifted up by one, its low half H holds
// x^63..x^32 and its high half L x^31..x^0, so a b = H x^32 + L, and H x^32 mod P is the raw
// crc32 of H's four bytes from a zero register.
__attribute__((target("sse4.2,pclmul"))) uint32_t MulModClmul(uint32_t a, uint32_t b) {
  const __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128(static_cast<int>(a)),
                                               _mm_cvtsi32_si128(static_cast<int>(b)), 0x00);
  const uint64_t c = static_cast<uint64_t>(_mm_cvtsi128_si64(product)) << 1;
  return _mm_crc32_u32(0, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c >> 32);
}
#endif

using MulModFn = uint32_t (*)(uint32_t, uint32_t);
MulModFn ChooseMulMod() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul")) return MulModClmul;
#endif
  return MulModBitwise;
}

}  // namespace

uint32_t Crc32cMulMod(uint32_t a, uint32_t b) {
  static const MulModFn fn = ChooseMulMod();
  return fn(a, b);
}

uint32_t Crc32cMulModPortable(uint32_t a, uint32_t b) { return MulModBitwise(a, b); }

uint32_t Crc32cZerosFactor(uint64_t bytes) {
  // x^(2^k) for k = 0.., by squaring; x^(8 bytes) as the product of those its exponent holds.
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 30;   // x^1
  for (uint64_t e = bytes * 8; e != 0; e >>= 1) {
    if (e & 1) result = Crc32cMulMod(result, power);
    power = Crc32cMulMod(power, power);
  }
  return result;
}

uint32_t Crc32cAppendZeros(uint32_t crc, uint64_t bytes) {
  if (bytes == 0 || crc == 0) return crc;
  thread_local std::unordered_map<uint64_t, std::unique_ptr<Crc32cShift>> cache;
  auto it = cache.find(bytes);
  if (it == cache.end()) {
    if (cache.size() >= 256) cache.clear();
    it = cache.emplace(bytes, std::make_unique<Crc32cShift>(bytes)).first;
  }
  return (*it->second)(crc);
}

Crc32cShift::Crc32cShift(uint64_t bytes) : bytes_(bytes) {
  const uint32_t factor = Crc32cZerosFactor(bytes);
  for (uint32_t j = 0; j < 4; ++j) {
    for (uint32_t i = 0; i < 256; ++i) table_[j][i] = Crc32cMulMod(i << (8 * j), factor);
  }
}

}  // namespace v1
}  // namespace pdlib
