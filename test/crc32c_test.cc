#include "lib/base/crc32c.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string_view>
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
      for (std::string_view path : pdlib::Crc32cPaths()) {
        INFO("path " << path);
        CHECK(pdlib::Crc32cRawBy(path, 0x1234u, data.data() + offset, n) == want);
      }
    }
  }
}

TEST_CASE("crc32c: multiplication modulo the polynomial, fast and bitwise agree") {
  std::mt19937 rng(9);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t a = rng(), b = i % 7 == 0 ? (1u << (i % 32)) : static_cast<uint32_t>(rng());
    INFO(a << " * " << b);
    REQUIRE(pdlib::Crc32cMulMod(a, b) == pdlib::Crc32cMulModPortable(a, b));
  }
  // x^0 is one; x^32 = P's low terms (the reflected polynomial).
  CHECK(pdlib::Crc32cMulMod(0x12345678u, 1u << 31) == 0x12345678u);
  CHECK(pdlib::Crc32cMulMod(1u << 31, pdlib::Crc32cZerosFactor(4)) == 0x82F63B78u);
}

TEST_CASE("crc32c: the folding path around its block sizes, from any register value") {
  // Folding takes 256-byte rounds, then 64-byte blocks, then 16-byte lanes, then bytes: every
  // length from 240 to 600 crosses each boundary; registers 0, all ones and an odd one.
  const auto paths = pdlib::Crc32cPaths();
  INFO("paths here: " << paths.size() << ", fastest " << pdlib::Crc32cImplementation());
  REQUIRE(paths.back() == "portable");
  CHECK_FALSE(pdlib::Crc32cRawBy("no-such-path", 0, "x", 1).has_value());
  const auto data = Random(4096 + 64 * 4 + 32, 4);
  for (uint32_t start : {0u, 0xFFFFFFFFu, 0x9E3779B9u}) {
    for (size_t n = 240; n <= 600; ++n) {
      const uint32_t want = BitwiseRaw(start, data.data() + 5, n);
      for (std::string_view path : paths) {
        INFO("path " << path << " length " << n << " start " << start);
        REQUIRE(pdlib::Crc32cRawBy(path, start, data.data() + 5, n) == want);
      }
    }
    // Long: many 256-byte rounds, every 64-byte tail count.
    for (size_t n : {4096u, 4096u + 64, 4096u + 64 * 3 + 15, 4095u}) {
      const uint32_t want = BitwiseRaw(start, data.data() + 3, n);
      for (std::string_view path : paths) {
        INFO("path " << path << " length " << n);
        CHECK(pdlib::Crc32cRawBy(path, start, data.data() + 3, n) == want);
      }
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

TEST_CASE("crc32c: Crc32cCopy copies exactly and returns the CRC of what it copied") {
  const auto data = Random(70000, 6);
  for (uint32_t start : {0u, 0xFFFFFFFFu, 0x1234567u}) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{15}, size_t{63}, size_t{255}, size_t{256}, size_t{257},
          size_t{319}, size_t{4096}, size_t{32768}, size_t{32768 + 77}, size_t{65536 + 13}}) {
      for (size_t offset : {size_t{0}, size_t{3}}) {
        std::vector<uint8_t> out(n + 64, 0xEE);
        INFO("length " << n << " offset " << offset << " start " << start);
        const uint32_t crc = pdlib::Crc32cCopy(start, out.data() + 32, data.data() + offset, n);
        CHECK(crc == Crc32cRawPortable(start, data.data() + offset, n));
        CHECK(std::memcmp(out.data() + 32, data.data() + offset, n) == 0);
        // Nothing written outside [dst, dst + n).
        CHECK(std::all_of(out.begin(), out.begin() + 32, [](uint8_t b) { return b == 0xEE; }));
        CHECK(std::all_of(out.begin() + 32 + static_cast<std::ptrdiff_t>(n), out.end(),
                          [](uint8_t b) { return b == 0xEE; }));
      }
    }
  }
}
