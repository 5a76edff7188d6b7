// The router's pure decisions: which prefill and which decode host serve a request (the load
// balancing policies) and which bootstrap room it gets. No I/O, no threads, no clocks: the
// caller passes the loads it tracks and a seeded random engine, so every choice is reproducible
// and unit-tested (test/examples/router_policy_test.cc).
//
// Threads: the functions are pure; RoomGenerator is not thread-safe (the router calls it under
// its pick lock).
#ifndef PDLIB_EXAMPLES_ROUTER_POLICY_H_
#define PDLIB_EXAMPLES_ROUTER_POLICY_H_

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>

#include "pdlib/status.h"

namespace pdlib::router {

enum class Policy {
  kRandom,       // uniform over the available hosts
  kPowerOfTwo,   // two distinct random candidates, the less loaded one (ties: the first drawn)
  kLeastLoaded,  // the least loaded host; ties are broken uniformly at random, so that idle
                 // hosts share sequential requests instead of the lowest index taking them all
};

// "random", "power-of-two", "least-loaded".
std::string_view PolicyName(Policy policy);
StatusOr<Policy> ParsePolicy(std::string_view name);

// One host as a policy sees it.
struct HostLoad {
  // Requests on the host: the router's own in-flight count, or the host's running + queued
  // from its last GetLoad when that is higher (see HostPool::Snapshot).
  int64_t load = 0;
  // False while the host is skipped after an UNAVAILABLE error (see HostPool).
  bool available = true;
};

// Picks an index into `hosts`, or -1 when `hosts` is empty. Only available hosts are
// candidates; when none is available every host is, so that a request still goes somewhere
// and fails with that host's own reason rather than a generic "no host".
int PickHost(Policy policy, std::span<const HostLoad> hosts, std::mt19937_64& rng);

// Bootstrap rooms: a counter from a random 63-bit start, so rooms are unique within a router
// for 2^63 requests, never 0 (pdlib reserves it), and two routers with different seeds almost
// never collide (their ranges overlap only if their starts are within the number of requests
// served). Consecutive rooms also spread requests evenly over a prefill's DP ranks, which
// decode picks as room % dp_size.
class RoomGenerator {
 public:
  explicit RoomGenerator(uint64_t seed);
  // A generator whose next room is `first` (masked to 63 bits): for tests of the wrap-around.
  static RoomGenerator StartingAt(uint64_t first);
  uint64_t Next();

 private:
  uint64_t next_;
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_POLICY_H_
