#include "lib/core/kv_digest.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "lib/base/crc32c.h"

using pdlib::AddWritesToDigest;
using pdlib::DigestLanded;
using pdlib::DigestMemory;
using pdlib::KvDigest;
using pdlib::PagePositions;
using pdlib::planner::PlannedWrite;
using pdlib::planner::RegionKind;

namespace {

uint64_t Addr(const std::vector<uint8_t>& v) { return reinterpret_cast<uint64_t>(v.data()); }

// Decode: 2 KV buffers of 8 pages of 64 bytes, one aux buffer of 4 rows of 16 bytes. Two senders,
// each holding half of every page's bytes (two 16-byte pieces per page: heads sliced
// [token][head] with 2 tokens x 2 heads x 16 bytes), as M:N TP moves them.
struct Scene {
  static constexpr uint64_t kPage = 64, kPages = 8, kAux = 16;
  std::vector<uint8_t> src[2][2];  // sender, KV buffer: 8 pages of 32 bytes (its head)
  std::vector<uint8_t> src_aux;    // sender 0's aux: 4 rows
  std::vector<uint8_t> dst[2];     // decode's KV buffers
  std::vector<uint8_t> dst_aux;
  std::vector<int32_t> dst_pages = {5, 2, 7};  // the request's pages on decode
  std::vector<int32_t> src_pages = {1, 3, 6};

  Scene() {
    for (int s = 0; s < 2; ++s) {
      for (int b = 0; b < 2; ++b) {
        src[s][b].resize(kPages * 32);
        for (size_t i = 0; i < src[s][b].size(); ++i) src[s][b][i] = uint8_t(i * 7 + s * 31 + b);
      }
    }
    src_aux.resize(4 * kAux);
    for (size_t i = 0; i < src_aux.size(); ++i) src_aux[i] = uint8_t(200 + i);
    for (auto& d : dst) d.assign(kPages * kPage, 0xEE);  // stale content
    dst_aux.assign(4 * kAux, 0xEE);
  }
  // Sender s's writes: per buffer, per page, its two pieces (token t, head s).
  std::vector<PlannedWrite> Writes(int s) const {
    std::vector<PlannedWrite> w;
    for (uint32_t b = 0; b < 2; ++b) {
      for (size_t i = 0; i < dst_pages.size(); ++i) {
        for (uint64_t t = 0; t < 2; ++t) {
          w.push_back({RegionKind::kKv, b, src_pages[i] * 32 + t * 16, b,
                       dst_pages[i] * kPage + t * 32 + s * 16, 16});
        }
      }
    }
    if (s == 0) w.push_back({RegionKind::kAux, 0, 2 * kAux, 0, 3 * kAux, kAux});
    return w;
  }
  DigestMemory Source(int s) const {
    DigestMemory m;
    m.kv = {Addr(src[s][0]), Addr(src[s][1])};
    m.aux = {Addr(src_aux)};
    return m;
  }
  DigestMemory Decode() const {
    DigestMemory m;
    m.kv = {Addr(dst[0]), Addr(dst[1])};
    m.kv_item = {kPage, kPage};
    m.aux = {Addr(dst_aux)};
    m.aux_item = {kAux};
    return m;
  }
  // What the writes do, by memcpy.
  void Apply(const std::vector<PlannedWrite>& writes, int s) {
    for (const auto& w : writes) {
      if (w.kind == RegionKind::kAux) {
        std::memcpy(dst_aux.data() + w.remote_offset, src_aux.data() + w.local_offset, w.length);
      } else {
        std::memcpy(dst[w.remote_buffer].data() + w.remote_offset,
                    src[s][w.local_buffer].data() + w.local_offset, w.length);
      }
    }
  }
  KvDigest Expected() const {
    KvDigest sum = KvDigest::Empty(2, dst_pages.size(), 1, 0, 0);
    PagePositions pos(dst_pages);
    for (int s = 0; s < 2; ++s) {
      KvDigest d = KvDigest::Empty(2, dst_pages.size(), 1, 0, 0);
      REQUIRE(AddWritesToDigest(Writes(s), Source(s), Decode(), pos, &d).ok());
      REQUIRE(sum.Merge(d).ok());
    }
    return sum;
  }
  KvDigest Landed(const KvDigest& expected) const {
    auto d = DigestLanded(Decode(), dst_pages, 3, {}, expected);
    REQUIRE(d.ok());
    return *d;
  }
};

std::string Name(uint32_t b) { return "buffer " + std::to_string(b); }

}  // namespace

TEST_CASE("kv digest: two senders' halves of every page add up to decode's pass") {
  Scene sc;
  sc.Apply(sc.Writes(0), 0);
  sc.Apply(sc.Writes(1), 1);
  const KvDigest want = sc.Expected();
  const KvDigest got = sc.Landed(want);
  CHECK(got.kv == want.kv);
  CHECK(got.pages == want.pages);
  CHECK(got.aux == want.aux);
  CHECK(want.kv[0] != 0);
}

TEST_CASE("kv digest: a flipped byte, a lost piece, a page written to the wrong place are found") {
  Scene sc;
  auto w1 = sc.Writes(1);
  SECTION("a byte flipped in flight: that buffer and that page's column") {
    sc.Apply(sc.Writes(0), 0);
    sc.Apply(w1, 1);
    sc.dst[1][sc.dst_pages[2] * Scene::kPage + 40] ^= 0x10;
    const KvDigest want = sc.Expected();
    std::vector<uint64_t> bad;
    const std::string what =
        pdlib::DescribeDigestMismatch(want, sc.Landed(want), sc.dst_pages.size(), Name, &bad);
    CHECK(what == "buffer 1; request pages [2, 3)");
    CHECK(bad == std::vector<uint64_t>{2});
  }
  SECTION("a piece never written (stale bytes stay)") {
    sc.Apply(sc.Writes(0), 0);
    w1.erase(w1.begin() + 3);  // buffer 0, page position 1, token 1
    sc.Apply(w1, 1);
    const KvDigest want = sc.Expected();
    std::vector<uint64_t> bad;
    const std::string what =
        pdlib::DescribeDigestMismatch(want, sc.Landed(want), sc.dst_pages.size(), Name, &bad);
    CHECK(what == "buffer 0; request pages [1, 2)");
  }
  SECTION("pages swapped on decode: same bytes, wrong places") {
    sc.Apply(sc.Writes(0), 0);
    sc.Apply(w1, 1);
    std::vector<uint8_t> tmp(sc.dst[0].begin() + 5 * Scene::kPage,
                             sc.dst[0].begin() + 6 * Scene::kPage);
    std::memcpy(sc.dst[0].data() + 5 * Scene::kPage, sc.dst[0].data() + 2 * Scene::kPage,
                Scene::kPage);
    std::memcpy(sc.dst[0].data() + 2 * Scene::kPage, tmp.data(), Scene::kPage);
    const KvDigest want = sc.Expected();
    std::vector<uint64_t> bad;
    const std::string what =
        pdlib::DescribeDigestMismatch(want, sc.Landed(want), sc.dst_pages.size(), Name, &bad);
    CHECK(what == "buffer 0; request pages [0, 2)");
  }
  SECTION("the aux row") {
    sc.Apply(sc.Writes(0), 0);
    sc.Apply(w1, 1);
    sc.dst_aux[3 * Scene::kAux] ^= 1;
    const KvDigest want = sc.Expected();
    std::vector<uint64_t> bad;
    CHECK(pdlib::DescribeDigestMismatch(want, sc.Landed(want), 3, Name, &bad) == "aux buffer 0");
    CHECK(bad.empty());
  }
}

TEST_CASE("kv digest: shapes and bad input") {
  KvDigest a = KvDigest::Empty(2, 100, 1, 0, 0);
  KvDigest b = KvDigest::Empty(2, 200, 1, 0, 0);
  CHECK(a.page_group == 2);
  CHECK(a.pages.size() == 50);
  CHECK(b.pages.size() == 50);  // 64 columns at most: 4 pages each
  CHECK(b.page_group == 4);
  auto s = a.Merge(b);
  CHECK(s.code() == pdlib::StatusCode::kInvalidArgument);
  // A write outside decode's layout is refused, not followed.
  Scene sc;
  PagePositions pos(sc.dst_pages);
  KvDigest d = KvDigest::Empty(2, 3, 1, 0, 0);
  std::vector<PlannedWrite> w = {{RegionKind::kKv, 0, 0, 7, 0, 16}};
  CHECK(!AddWritesToDigest(w, sc.Source(0), sc.Decode(), pos, &d).ok());
  w = {{RegionKind::kKv, 0, 0, 0, 4 * Scene::kPage, 16}};  // page 4 is not the request's
  CHECK(!AddWritesToDigest(w, sc.Source(0), sc.Decode(), pos, &d).ok());
  // A digest of another shape than decode's.
  CHECK(!DigestLanded(sc.Decode(), sc.dst_pages, 3, {}, KvDigest::Empty(3, 3, 1, 0, 0)).ok());
}

TEST_CASE("kv digest: decode's pass over what the transport copied, by cell, instead of memory") {
  // A reader (the transport's landing digests) answers for every cell DigestLanded asks about;
  // LandingCells lists exactly those cells (and any state slot), so a watch covers the pass.
  Scene sc;
  sc.Apply(sc.Writes(0), 0);
  sc.Apply(sc.Writes(1), 1);
  const KvDigest want = sc.Expected();
  const std::vector<pdlib::spi::DigestRange> cells =
      pdlib::LandingCells(sc.Decode(), sc.dst_pages, 3, {});
  REQUIRE(cells.size() == 2 * sc.dst_pages.size() + 1);  // 2 buffers x 3 pages, the aux row
  size_t asked = 0;
  // What was copied equals memory: the same digest as reading memory.
  pdlib::RangeCrcFn copied = [&](std::span<const pdlib::spi::DigestRange> ranges,
                                 std::span<uint32_t> crcs) {
    for (size_t i = 0; i < ranges.size(); ++i) {
      REQUIRE(std::find_if(cells.begin(), cells.end(), [&](const auto& c) {
                return c.addr == ranges[i].addr && c.length == ranges[i].length;
              }) != cells.end());
      ++asked;
    }
    return pdlib::HostRangeCrcs(ranges, crcs);
  };
  auto same = DigestLanded(sc.Decode(), sc.dst_pages, 3, {}, want, copied);
  REQUIRE(same.ok());
  CHECK(asked == cells.size());
  CHECK(same->kv == want.kv);
  CHECK(same->aux == want.aux);
  // The transport copied one wrong byte of buffer 1's page 7 (memory was fixed since, or never
  // held it): the reader's value counts, the mismatch is narrowed to that buffer and column.
  std::vector<uint8_t> wrong(sc.dst[1].begin() + 7 * Scene::kPage,
                             sc.dst[1].begin() + 8 * Scene::kPage);
  wrong[9] ^= 0x01;
  const uint64_t page7 = Addr(sc.dst[1]) + 7 * Scene::kPage;
  pdlib::RangeCrcFn bad = [&](std::span<const pdlib::spi::DigestRange> ranges,
                              std::span<uint32_t> crcs) {
    REQUIRE(pdlib::HostRangeCrcs(ranges, crcs).ok());
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].addr == page7) crcs[i] = pdlib::Crc32cRaw(0, wrong.data(), wrong.size());
    }
    return pdlib::Status::OK();
  };
  auto diff = DigestLanded(sc.Decode(), sc.dst_pages, 3, {}, want, bad);
  REQUIRE(diff.ok());
  CHECK(diff->kv[0] == want.kv[0]);
  CHECK(diff->kv[1] != want.kv[1]);
  std::vector<uint64_t> positions;
  const std::string what = pdlib::DescribeDigestMismatch(want, *diff, 3, Name, &positions);
  CHECK(what == "buffer 1; request pages [2, 3)");
  CHECK(positions == std::vector<uint64_t>{2});
}
