#include "lib/base/crc32c.h"

#include <cstring>
#include <memory>
#include <unordered_map>

#if defined(__x86_64__)
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
struct Chosen {
  Impl fn = Portable;
  const char* name = "portable";
  Chosen() {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2")) {
      fn = Sse42;
      name = "sse4.2";
    }
#elif defined(__aarch64__) && defined(__linux__)
    if (getauxval(AT_HWCAP) & HWCAP_CRC32) {
      fn = Armv8;
      name = "armv8-crc";
    }
#endif
  }
};
const Chosen& Choice() {
  static const Chosen chosen;
  return chosen;
}

}  // namespace

uint32_t Crc32cRaw(uint32_t crc, const void* data, size_t n) {
  return Choice().fn(crc, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32cRawPortable(uint32_t crc, const void* data, size_t n) {
  return Portable(crc, static_cast<const uint8_t*>(data), n);
}

const char* Crc32cImplementation() { return Choice().name; }

uint32_t Crc32cMulMod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b * x
  }
  return product;
}

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
