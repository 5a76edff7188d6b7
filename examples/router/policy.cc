#include "examples/router/policy.h"

#include <algorithm>
#include <vector>

namespace pdlib::router {
namespace {

constexpr uint64_t kRoomMask = (uint64_t{1} << 63) - 1;

// splitmix64: turns a small or sequential seed into a well-spread start.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

size_t Uniform(size_t n, std::mt19937_64& rng) {
  return std::uniform_int_distribution<size_t>(0, n - 1)(rng);
}

}  // namespace

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kRandom: return "random";
    case Policy::kPowerOfTwo: return "power-of-two";
    case Policy::kLeastLoaded: return "least-loaded";
  }
  return "unknown";
}

StatusOr<Policy> ParsePolicy(std::string_view name) {
  for (Policy p : {Policy::kRandom, Policy::kPowerOfTwo, Policy::kLeastLoaded}) {
    if (name == PolicyName(p)) return p;
  }
  return Status::InvalidArgument("unknown policy '" + std::string(name) +
                                 "' (expected random, power-of-two or least-loaded)");
}

int PickHost(Policy policy, std::span<const HostLoad> hosts, std::mt19937_64& rng) {
  if (hosts.empty()) return -1;
  std::vector<int> candidates;
  candidates.reserve(hosts.size());
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (hosts[i].available) candidates.push_back(static_cast<int>(i));
  }
  if (candidates.empty()) {
    for (size_t i = 0; i < hosts.size(); ++i) candidates.push_back(static_cast<int>(i));
  }
  const size_t n = candidates.size();
  if (n == 1) return candidates[0];
  switch (policy) {
    case Policy::kRandom: return candidates[Uniform(n, rng)];
    case Policy::kPowerOfTwo: {
      const size_t a = Uniform(n, rng);
      size_t b = Uniform(n - 1, rng);  // distinct from a: skip over it
      if (b >= a) ++b;
      const int ia = candidates[a], ib = candidates[b];
      return hosts[ib].load < hosts[ia].load ? ib : ia;
    }
    case Policy::kLeastLoaded: {
      int64_t best = hosts[candidates[0]].load;
      for (int i : candidates) best = std::min(best, hosts[i].load);
      std::vector<int> ties;
      for (int i : candidates) {
        if (hosts[i].load == best) ties.push_back(i);
      }
      return ties.size() == 1 ? ties[0] : ties[Uniform(ties.size(), rng)];
    }
  }
  return candidates[0];
}

RoomGenerator::RoomGenerator(uint64_t seed) : next_(Mix(seed) & kRoomMask) {}

RoomGenerator RoomGenerator::StartingAt(uint64_t first) {
  RoomGenerator g(0);
  g.next_ = first & kRoomMask;
  return g;
}

uint64_t RoomGenerator::Next() {
  uint64_t room = next_;
  if (room == 0) room = 1;  // wrapped (or started) at 0; 1 is next in the sequence anyway
  next_ = (room + 1) & kRoomMask;
  return room;
}

}  // namespace pdlib::router
