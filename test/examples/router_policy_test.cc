// pd-router's pure pieces: the load-balancing policies (properties of their choices over many
// draws, not exact random values), bootstrap rooms, the byte-level tokenizer and request
// validation.
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "examples/router/policy.h"
#include "examples/router/request.h"
#include "examples/router/tokenizer.h"

namespace pdlib::router {
namespace {

std::vector<int> Counts(Policy policy, const std::vector<HostLoad>& hosts, int draws,
                        uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::vector<int> counts(hosts.size(), 0);
  for (int i = 0; i < draws; ++i) {
    const int pick = PickHost(policy, hosts, rng);
    REQUIRE(pick >= 0);
    REQUIRE(pick < static_cast<int>(hosts.size()));
    ++counts[static_cast<size_t>(pick)];
  }
  return counts;
}

std::vector<HostLoad> WithLoads(std::vector<int64_t> loads) {
  std::vector<HostLoad> hosts;
  for (int64_t l : loads) hosts.push_back({.load = l, .available = true});
  return hosts;
}

// |count / draws - p| within `tolerance`.
bool Near(int count, int draws, double p, double tolerance = 0.02) {
  const double f = static_cast<double>(count) / draws;
  return f > p - tolerance && f < p + tolerance;
}

}  // namespace

TEST_CASE("router policy: names parse and print both ways") {
  for (Policy p : {Policy::kRandom, Policy::kPowerOfTwo, Policy::kLeastLoaded}) {
    StatusOr<Policy> parsed = ParsePolicy(PolicyName(p));
    REQUIRE(parsed.ok());
    CHECK(*parsed == p);
  }
  StatusOr<Policy> bad = ParsePolicy("round-robin");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(std::string(bad.status().message()).find("round-robin") != std::string::npos);
  CHECK(std::string(bad.status().message()).find("power-of-two") != std::string::npos);
}

TEST_CASE("router policy: no hosts gives -1, one host is always picked") {
  std::mt19937_64 rng(7);
  for (Policy p : {Policy::kRandom, Policy::kPowerOfTwo, Policy::kLeastLoaded}) {
    CHECK(PickHost(p, {}, rng) == -1);
    const std::vector<HostLoad> one = WithLoads({42});
    CHECK(PickHost(p, one, rng) == 0);
    const std::vector<HostLoad> one_down = {{.load = 0, .available = false}};
    CHECK(PickHost(p, one_down, rng) == 0);  // all skipped: use them anyway
  }
}

TEST_CASE("router policy: random is uniform and ignores load") {
  const int draws = 40000;
  const std::vector<int> counts = Counts(Policy::kRandom, WithLoads({0, 100, 5, 1000}), draws);
  for (int c : counts) CHECK(Near(c, draws, 0.25));
}

TEST_CASE("router policy: power-of-two prefers less loaded hosts, never the most loaded") {
  // Loads 0 < 1 < 2 < 3: a host wins every pair with a more loaded one. Of the 6 pairs, host 0
  // is in 3, host 1 wins 2, host 2 wins 1, host 3 none.
  const int draws = 60000;
  const std::vector<int> counts = Counts(Policy::kPowerOfTwo, WithLoads({0, 1, 2, 3}), draws);
  CHECK(Near(counts[0], draws, 3.0 / 6));
  CHECK(Near(counts[1], draws, 2.0 / 6));
  CHECK(Near(counts[2], draws, 1.0 / 6));
  CHECK(counts[3] == 0);
}

TEST_CASE("router policy: power-of-two spreads evenly over equally loaded hosts") {
  const int draws = 40000;
  const std::vector<int> counts = Counts(Policy::kPowerOfTwo, WithLoads({3, 3, 3, 3}), draws);
  for (int c : counts) CHECK(Near(c, draws, 0.25));
}

TEST_CASE("router policy: least-loaded always picks a minimum, ties at random") {
  const int draws = 20000;
  std::vector<int> counts = Counts(Policy::kLeastLoaded, WithLoads({4, 1, 7, 2}), draws);
  CHECK(counts == std::vector<int>{0, draws, 0, 0});
  counts = Counts(Policy::kLeastLoaded, WithLoads({2, 0, 5, 0, 0}), draws);
  CHECK(counts[0] == 0);
  CHECK(counts[2] == 0);
  for (int i : {1, 3, 4}) CHECK(Near(counts[static_cast<size_t>(i)], draws, 1.0 / 3));
}

TEST_CASE("router policy: skipped hosts are not picked while another is available") {
  std::vector<HostLoad> hosts = WithLoads({0, 9, 9, 9});
  hosts[0].available = false;  // the least loaded, but skipped
  hosts[2].available = false;
  for (Policy p : {Policy::kRandom, Policy::kPowerOfTwo, Policy::kLeastLoaded}) {
    const std::vector<int> counts = Counts(p, hosts, 5000);
    CHECK(counts[0] == 0);
    CHECK(counts[2] == 0);
    CHECK(counts[1] + counts[3] == 5000);
    CHECK(counts[1] > 0);  // both available ones get requests
    CHECK(counts[3] > 0);
  }
  // All skipped: every host is a candidate again (requests fail with the host's own reason).
  for (auto& h : hosts) h.available = false;
  const std::vector<int> counts = Counts(Policy::kRandom, hosts, 8000);
  for (int c : counts) CHECK(c > 0);
}

TEST_CASE("router policy: the same seed makes the same choices") {
  const std::vector<HostLoad> hosts = WithLoads({1, 1, 2, 0, 1});
  for (Policy p : {Policy::kRandom, Policy::kPowerOfTwo, Policy::kLeastLoaded}) {
    std::mt19937_64 a(99), b(99);
    for (int i = 0; i < 200; ++i) CHECK(PickHost(p, hosts, a) == PickHost(p, hosts, b));
  }
}

TEST_CASE("router rooms: unique, non-zero, 63-bit, seed-dependent") {
  RoomGenerator g(12345);
  std::set<uint64_t> seen;
  for (int i = 0; i < 100000; ++i) {
    const uint64_t room = g.Next();
    CHECK(room != 0);
    CHECK(room < (uint64_t{1} << 63));
    seen.insert(room);
  }
  CHECK(seen.size() == 100000);
  RoomGenerator other(12346);
  CHECK(other.Next() != RoomGenerator(12345).Next());
  CHECK(RoomGenerator(5).Next() == RoomGenerator(5).Next());
}

TEST_CASE("router rooms: the counter wraps at 2^63 and skips 0") {
  const uint64_t max = (uint64_t{1} << 63) - 1;
  RoomGenerator g = RoomGenerator::StartingAt(max - 1);
  CHECK(g.Next() == max - 1);
  CHECK(g.Next() == max);
  CHECK(g.Next() == 1);  // not 0
  CHECK(g.Next() == 2);
  RoomGenerator z = RoomGenerator::StartingAt(0);
  CHECK(z.Next() == 1);
  CHECK(z.Next() == 2);
}

TEST_CASE("router tokenizer: bytes in, bytes out, other ids as <id>") {
  const std::string text = "Hi \xc3\xa9\n";
  const std::vector<int32_t> ids = Tokenize(text);
  CHECK(ids == std::vector<int32_t>{'H', 'i', ' ', 0xc3, 0xa9, '\n'});
  CHECK(Detokenize(ids) == text);
  const std::vector<int32_t> mixed = {'a', 256, 'b', 31999};
  CHECK(Detokenize(mixed) == "a<256>b<31999>");
  CHECK(Detokenize(std::vector<int32_t>{}).empty());
}

TEST_CASE("router tokenizer: the stream detokenizer holds back half a UTF-8 character") {
  StreamDetokenizer d;
  CHECK(d.Feed('a') == "a");
  CHECK(d.Feed(0xe2).empty());  // first of 3 bytes of U+20AC
  CHECK(d.Feed(0x82).empty());
  CHECK(d.Feed(0xac) == "\xe2\x82\xac");
  CHECK(d.Feed(0xc3).empty());
  CHECK(d.Feed('x') == "\xc3x");  // never completed: passed on as is
  CHECK(d.Feed(0xf0).empty());
  CHECK(d.Finish() == "\xf0");
  CHECK(d.Feed(300) == "<300>");
}

TEST_CASE("router request: validation and defaults") {
  const std::vector<int32_t> none;
  StatusOr<RouterRequest> r = MakeRouterRequest(none, "abc", 0, 16);
  REQUIRE(r.ok());
  CHECK(r->prompt_ids == std::vector<int32_t>{'a', 'b', 'c'});
  CHECK(r->max_new_tokens == 16);

  const std::vector<int32_t> ids = {5, 6};
  r = MakeRouterRequest(ids, "ignored", 3, 16);
  REQUIRE(r.ok());
  CHECK(r->prompt_ids == ids);
  CHECK(r->max_new_tokens == 3);

  r = MakeRouterRequest(none, "", 1, 16);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(std::string(r.status().message()).find("empty prompt") != std::string::npos);

  const std::vector<int32_t> negative = {1, -2};
  r = MakeRouterRequest(negative, "", 1, 16);
  REQUIRE_FALSE(r.ok());
  CHECK(std::string(r.status().message()).find("prompt token 1 is -2") != std::string::npos);

  r = MakeRouterRequest(none, "x", -1, 16);
  REQUIRE_FALSE(r.ok());
  CHECK(std::string(r.status().message()).find("max_new_tokens is -1") != std::string::npos);
}

}  // namespace pdlib::router
