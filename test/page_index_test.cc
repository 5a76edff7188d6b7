#include "pdlib/page_index.h"

#include <catch2/catch.hpp>
#include <random>

using pdlib::PageRun;

TEST_CASE("token indices map to page indices") {
  // Tokens 0..39 of a request living in pages 5, 6 and 2 (page size 16, last page partial).
  std::vector<int32_t> tokens;
  for (int p : {5, 6, 2}) {
    for (int t = 0; t < 16; ++t) tokens.push_back(p * 16 + t);
  }
  tokens.resize(40);
  auto pages = pdlib::TokenIndicesToPageIndices(tokens, 16);
  REQUIRE(pages.ok());
  CHECK(*pages == std::vector<int32_t>{5, 6, 2});
  CHECK(pdlib::PageCount(40, 16) == 3);
  CHECK(pdlib::PageCount(48, 16) == 3);
  CHECK(pdlib::PageCount(0, 16) == 0);
  CHECK_FALSE(pdlib::TokenIndicesToPageIndices(tokens, 0).ok());
  tokens[16] = -1;
  CHECK(pdlib::TokenIndicesToPageIndices(tokens, 16).status().code() ==
        pdlib::StatusCode::kInvalidArgument);
}

TEST_CASE("coalescing merges runs where both sides advance") {
  std::vector<int32_t> src = {1, 2, 3, 7, 8, 10, 11, 12};
  std::vector<int32_t> dst = {4, 5, 6, 9, 20, 21, 22, 23};
  std::vector<PageRun> runs;
  REQUIRE(pdlib::CoalescePageRuns(src, dst, &runs).ok());
  CHECK(runs == std::vector<PageRun>{{1, 4, 3}, {7, 9, 1}, {8, 20, 1}, {10, 21, 3}});
  REQUIRE(pdlib::CoalescePageRuns({}, {}, &runs).ok());
  CHECK(runs.empty());
  CHECK(pdlib::CoalescePageRuns(src, std::span(dst).first(3), &runs).code() ==
        pdlib::StatusCode::kInvalidArgument);
}

TEST_CASE("coalesced runs expand back to the input pairs") {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    size_t n = rng() % 300;
    std::vector<int32_t> src(n), dst(n);
    int32_t s = rng() % 100, d = rng() % 100;
    for (size_t i = 0; i < n; ++i) {
      s = (rng() % 4 == 0) ? static_cast<int32_t>(rng() % 1000) : s + 1;
      d = (rng() % 4 == 0) ? static_cast<int32_t>(rng() % 1000) : d + 1;
      src[i] = s;
      dst[i] = d;
    }
    std::vector<PageRun> runs;
    REQUIRE(pdlib::CoalescePageRuns(src, dst, &runs).ok());
    std::vector<int32_t> src2, dst2;
    for (const auto& r : runs) {
      REQUIRE(r.count > 0);
      for (int k = 0; k < r.count; ++k) {
        src2.push_back(r.src_start + k);
        dst2.push_back(r.dst_start + k);
      }
    }
    CHECK(src2 == src);
    CHECK(dst2 == dst);
    // Maximal: two neighbouring runs could not have been merged.
    for (size_t i = 1; i < runs.size(); ++i) {
      bool mergeable = runs[i].src_start == runs[i - 1].src_start + runs[i - 1].count &&
                       runs[i].dst_start == runs[i - 1].dst_start + runs[i - 1].count;
      CHECK_FALSE(mergeable);
    }
  }
}
