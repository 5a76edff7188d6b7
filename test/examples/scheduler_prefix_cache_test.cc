// PrefixCache (examples/scheduler/prefix_cache.h): the decode scheduler's cache of finished
// requests' pages for decode prefix reuse.
#include <catch2/catch.hpp>
#include <numeric>
#include <vector>

#include "examples/scheduler/prefix_cache.h"

namespace pdlib::sched {
namespace {

std::vector<int32_t> Tokens(int n, int32_t first = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST_CASE("prefix cache: a later prompt that extends a finished one matches its full pages") {
  PrefixCache cache(4, 64);
  std::vector<int32_t> evicted;
  const std::vector<int32_t> turn1 = Tokens(10);  // 2 full pages + 2 tokens
  const std::vector<int32_t> table = {7, 3, 9};
  const auto adopted = cache.Insert(turn1, table, &evicted);
  CHECK(adopted == std::vector<size_t>{0, 1});  // the partial third page is not cached
  CHECK(cache.cached_pages() == 2);
  CHECK(evicted.empty());

  std::vector<int32_t> turn2 = turn1;
  for (int32_t t : {5, 6, 7, 8, 9}) turn2.push_back(t);
  auto m = cache.Lookup(turn2, static_cast<int64_t>(turn2.size()));
  CHECK(m.pages == std::vector<int32_t>{7, 3});
  CHECK(m.tokens == 8);
  CHECK(cache.evictable_pages() == 0);  // both locked
  // A prompt that differs in its second page matches only the first.
  std::vector<int32_t> other = turn2;
  other[5] = -1;
  auto m2 = cache.Lookup(other, static_cast<int64_t>(other.size()));
  CHECK(m2.pages == std::vector<int32_t>{7});
  // The same page content after another history is another page.
  std::vector<int32_t> shifted(turn2.begin() + 4, turn2.end());
  CHECK(cache.Lookup(shifted, 100).pages.empty());
  // max_tokens caps the match.
  auto m3 = cache.Lookup(turn2, 7);
  CHECK(m3.pages == std::vector<int32_t>{7});
  REQUIRE(cache.Unlock(m.pages).ok());
  REQUIRE(cache.Unlock(m2.pages).ok());
  REQUIRE(cache.Unlock(m3.pages).ok());
  CHECK(cache.evictable_pages() == 2);
  CHECK(cache.Unlock(m.pages).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("prefix cache: borrowed and duplicate pages are not adopted twice, and LRU eviction") {
  PrefixCache cache(2, 3);
  std::vector<int32_t> evicted;
  const std::vector<int32_t> a = Tokens(6, 0);
  CHECK(cache.Insert(a, std::vector<int32_t>{10, 11, 12}, &evicted).size() == 3);
  // A request that borrowed pages 10, 11 and computed page 20 for its third page: only the new
  // content is offered; the same content (pages 0..2 of `a`) under other page ids is not taken.
  auto m = cache.Lookup(a, 4);
  REQUIRE(m.pages == std::vector<int32_t>{10, 11});
  std::vector<int32_t> b = a;
  b.push_back(50);
  b.push_back(51);
  const auto adopted = cache.Insert(b, std::vector<int32_t>{10, 11, 30, 31}, &evicted);
  // Position 2 is a duplicate of cached page 12; position 3 is new, but the cache is full and
  // only page 12 is unlocked: it is evicted to make room.
  CHECK(adopted == std::vector<size_t>{3});
  CHECK(evicted == std::vector<int32_t>{12});
  CHECK(cache.cached_pages() == 3);
  // Another request's page: the one unlocked page (31) makes room; then all are locked and
  // nothing more fits.
  evicted.clear();
  const std::vector<int32_t> c = Tokens(2, 900);
  CHECK(cache.Insert(c, std::vector<int32_t>{40}, &evicted) == std::vector<size_t>{0});
  CHECK(evicted == std::vector<int32_t>{31});
  auto locked = cache.Lookup(c, 2);
  REQUIRE(locked.pages == std::vector<int32_t>{40});
  evicted.clear();
  CHECK(cache.Insert(Tokens(2, 700), std::vector<int32_t>{41}, &evicted).empty());
  CHECK(evicted.empty());
  REQUIRE(cache.Unlock(m.pages).ok());
  REQUIRE(cache.Unlock(locked.pages).ok());
  cache.Evict(5, &evicted);
  CHECK(evicted.size() == 3);
  CHECK(cache.cached_pages() == 0);
}

}  // namespace
}  // namespace pdlib::sched
