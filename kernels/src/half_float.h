// Host-side conversions between fp32 and the 16-bit float formats the kernels read and store.
// bf16 rounding is round-to-nearest-even, the same as CUDA's __float2bfloat16_rn, so the CPU
// and CUDA paths store identical bf16 KV for identical fp32 inputs.
#ifndef PDLIB_KERNELS_SRC_HALF_FLOAT_H_
#define PDLIB_KERNELS_SRC_HALF_FLOAT_H_

#include <cstdint>
#include <cstring>

namespace pdlib::kernels::internal {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16ToFloat(uint16_t h) { return FloatFromBits(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 to fp32, exact for every input (subnormals, infinities and NaN included).
inline float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return FloatFromBits(bits);
}

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_HALF_FLOAT_H_
