// Helpers shared by the verbs device tests and their target process: a byte pattern that
// depends on the seed and the offset (so a misplaced, stale or partial write is caught), and hex
// for passing blobs over the line protocol.
#ifndef PDLIB_TEST_VERBS_VERBS_TEST_UTIL_H_
#define PDLIB_TEST_VERBS_VERBS_TEST_UTIL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace verbs_test {

inline uint8_t PatternByte(uint32_t seed, uint64_t offset) {
  uint64_t x = (offset + 1) * 0x9e3779b97f4a7c15ULL ^ (uint64_t{seed} * 0xbf58476d1ce4e5b9ULL);
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

inline void FillPattern(uint8_t* data, uint64_t length, uint32_t seed, uint64_t first_offset = 0) {
  for (uint64_t i = 0; i < length; ++i) data[i] = PatternByte(seed, first_offset + i);
}

// nullopt when data[i] == PatternByte(seed, first_offset + i) for every i, else the first miss.
inline std::optional<std::string> FindMismatch(const uint8_t* data, uint64_t length, uint32_t seed,
                                               uint64_t first_offset = 0) {
  for (uint64_t i = 0; i < length; ++i) {
    if (data[i] != PatternByte(seed, first_offset + i)) {
      return "offset=" + std::to_string(first_offset + i) + ",got=" + std::to_string(data[i]) +
             ",expected=" + std::to_string(PatternByte(seed, first_offset + i));
    }
  }
  return std::nullopt;
}

inline std::string ToHex(const std::vector<uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

inline std::optional<std::vector<uint8_t>> FromHex(const std::string& text) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (text.size() % 2 != 0) return std::nullopt;
  std::vector<uint8_t> out;
  for (size_t i = 0; i < text.size(); i += 2) {
    const int hi = digit(text[i]), lo = digit(text[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<uint8_t>(hi * 16 + lo));
  }
  return out;
}

}  // namespace verbs_test

#endif  // PDLIB_TEST_VERBS_VERBS_TEST_UTIL_H_
