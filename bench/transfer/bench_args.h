// pdlib-transfer-bench's command line: the options, their --help text, and the flags that make a
// child process run one configuration.
#ifndef PDLIB_BENCH_TRANSFER_BENCH_ARGS_H_
#define PDLIB_BENCH_TRANSFER_BENCH_ARGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/transfer/bench_ranks.h"

namespace pdlib_bench {

// Everything the command line sets. The lists span configurations (every combination runs).
struct Options {
  BenchConfig base;
  std::vector<uint64_t> concurrency{256}, pages{4}, layers{4}, item_bytes{4096};
  std::vector<Layout> layouts{Layout::kScattered};
  std::vector<bool> layerwise{false};  // with layer_compute_us: off and/or on
  // --decode-prefix: {nullopt} without it; else the fractions asked for, with 0 first (added when
  // a fraction > 0 was asked without it: the same shape without a prefix, for the comparison).
  std::vector<std::optional<double>> decode_prefixes{std::nullopt};
  // --direction: push, pull, or both (push first: each pull row is compared with the push row of
  // the same configuration from this run).
  std::vector<pdlib::TransferDirection> directions{pdlib::TransferDirection::kPush};
  // --checksum: off, sampled, all, or a list (every row runs with each; rows with a checksum
  // are compared with the same configuration's row without one from this run).
  std::vector<pdlib::KvChecksum> checksums{pdlib::KvChecksum::kOff};
  bool json = false;
  bool in_process = false;
  bool baseline_memcpy = false;
  bool compare_perftest = false;
  // The prefill and the decode process each in a network namespace of its own (tools/netns),
  // UCX over tcp on eth0; and iperf3 over the same link for comparison.
  bool netns = false;
  bool compare_iperf3 = false;
  // --rails: with --netns, the links between the two hosts to use, each value a configuration
  // (the cluster has the most asked for); --rail_mbit: a tbf cap on every rail (0: none).
  std::vector<int> rails{1};
  int rail_mbit = 0;
  // --rail-fault R,AT,FOR: with --netns, rail R of decode's host is partitioned AT ms after the
  // decode rank is ready (warm-up included) and healed FOR ms later, in every row with more than
  // R rails; the rows then print the received throughput over time (rail < 0: no fault).
  struct RailFault {
    int rail = -1;
    int at_ms = 0;
    int for_ms = 0;
  } rail_fault;
  // --failures_ok: failed requests do not fail a row (a fault's expected casualties); wrong
  // bytes under --verify still do.
  bool failures_ok = false;
  // --stall_timeout: a two-process run gives up once no request ended for this long.
  double stall_timeout_s = 30;
  std::string role;  // hidden: "prefill" or "decode" in the child processes
};

// Parses argv into *o; prints --help and exits, or says what is wrong and returns false.
bool ParseArgs(int argc, char** argv, Options* o);

// The flags that make a child process run `c` (the parent's view of one configuration).
std::vector<std::string> ChildArgs(const BenchConfig& c, std::string_view role);

std::string_view LayoutName(Layout l);

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_BENCH_ARGS_H_
