#include "lib/base/crc32c.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

using pdlib::Crc32cMulMod;
using pdlib::Crc32cRaw;
using pdlib::Crc32cRawPortable;
using pdlib::Crc32cShift;
using pdlib::Crc32cZerosFactor;

namespace {

// The definition, bit by bit: what every faster path must agree with.
uint32_t BitwiseRaw(uint32_t crc, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return crc;
}

std::vector<uint8_t> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace

TEST_CASE("crc32c: the standard check value") {
  // CRC-32C of "123456789" is 0xE3069283 (init and final xor 0xFFFFFFFF around the raw CRC).
  const char* s = "123456789";
  CHECK((Crc32cRaw(0xFFFFFFFFu, s, 9) ^ 0xFFFFFFFFu) == 0xE3069283u);
  CHECK((Crc32cRawPortable(0xFFFFFFFFu, s, 9) ^ 0xFFFFFFFFu) == 0xE3069283u);
  INFO("implementation " << pdlib::Crc32cImplementation());
}

TEST_CASE("crc32c: every path equals the bitwise definition, any length and alignment") {
  const auto data = Random(3 * 4096 * 2 + 3 * 256 + 77, 1);
  for (size_t offset : std::initializer_list<size_t>{0, 1, 3, 7}) {
    for (size_t n :
         std::initializer_list<size_t>{0, 1, 7, 8, 9, 63, 255, 767, 768, 769, 3 * 4096 - 1,
                                       3 * 4096, 3 * 4096 + 13, data.size() - 7}) {
      const uint32_t want = BitwiseRaw(0x1234u, data.data() + offset, n);
      INFO("offset " << offset << " length " << n);
      CHECK(Crc32cRaw(0x1234u, data.data() + offset, n) == want);
      CHECK(Crc32cRawPortable(0x1234u, data.data() + offset, n) == want);
    }
  }
}

TEST_CASE("crc32c: continuing a CRC over pieces equals one pass") {
  const auto data = Random(50000, 2);
  uint32_t c = 0;
  for (size_t at = 0; at < data.size();) {
    const size_t n = std::min<size_t>(data.size() - at, 1 + (at * 7919) % 5000);
    c = Crc32cRaw(c, data.data() + at, n);
    at += n;
  }
  CHECK(c == Crc32cRaw(0, data.data(), data.size()));
}

TEST_CASE("crc32c: appending zeros multiplies by the zeros factor, the shift table agrees") {
  const auto data = Random(1000, 3);
  const uint32_t c = Crc32cRaw(0, data.data(), data.size());
  for (uint64_t zeros : std::initializer_list<uint64_t>{0, 1, 4, 15, 256, 4096, 12345}) {
    std::vector<uint8_t> z(zeros, 0);
    const uint32_t want = Crc32cRaw(c, z.data(), z.size());
    INFO(zeros << " zero bytes");
    CHECK(Crc32cMulMod(c, Crc32cZerosFactor(zeros)) == want);
    CHECK(Crc32cShift(zeros)(c) == want);
  }
  // x^0 is the identity.
  CHECK(Crc32cMulMod(c, 1u << 31) == c);
}

TEST_CASE("crc32c: raw CRCs of equal-length messages are linear (XOR)") {
  auto a = Random(4096 + 5, 4);
  auto b = Random(4096 + 5, 5);
  std::vector<uint8_t> x(a.size());
  for (size_t i = 0; i < a.size(); ++i) x[i] = a[i] ^ b[i];
  CHECK((Crc32cRaw(0, a.data(), a.size()) ^ Crc32cRaw(0, b.data(), b.size())) ==
        Crc32cRaw(0, x.data(), x.size()));
  // So a page two writers fill, each its own ranges, is the XOR of each writer's CRC over its
  // ranges with zeros elsewhere, computed without touching the zeros.
  std::vector<uint8_t> page(1024);
  for (size_t i = 0; i < page.size(); ++i) page[i] = static_cast<uint8_t>(i * 131 + 7);
  auto part = [&](size_t begin, size_t piece, size_t stride) {
    uint32_t c = 0;
    size_t end = 0;
    Crc32cShift gap(stride - piece);
    for (size_t at = begin; at + piece <= page.size(); at += stride) {
      if (at != begin) c = gap(c);
      c = Crc32cRaw(c, page.data() + at, piece);
      end = at + piece;
    }
    return Crc32cShift(page.size() - end)(c);
  };
  CHECK((part(0, 64, 128) ^ part(64, 64, 128)) == Crc32cRaw(0, page.data(), page.size()));
}
