#include "bench/transfer/baseline.h"

#include <chrono>
#include <cstring>
#include <map>

#include "bench/transfer/bench_layout.h"

namespace pdlib_bench {

std::vector<std::vector<pdlib::PageRun>> RequestRuns(const BenchConfig& c) {
  const PageRing src(c, PrefillPageSeed(c)), dst(c, DecodePageSeed(c));
  std::vector<std::vector<pdlib::PageRun>> runs(src.slots());
  for (uint64_t i = 0; i < src.slots(); ++i) {
    pdlib::CoalescePageRuns(src.For(i), dst.For(i), &runs[i]).IgnoreError();  // same lengths
  }
  return runs;
}

uint64_t TypicalWriteBytes(const BenchConfig& c,
                           const std::vector<std::vector<pdlib::PageRun>>& runs) {
  std::map<uint64_t, uint64_t> count;
  for (const auto& request : runs) {
    for (const pdlib::PageRun& run : request) ++count[uint64_t(run.count) * c.item_bytes];
  }
  uint64_t best = c.item_bytes, best_count = 0;
  for (const auto& [bytes, n] : count) {
    if (n > best_count) {
      best = bytes;
      best_count = n;
    }
  }
  return best;
}

BaselineResult RunMemcpyBaseline(const BenchConfig& c) {
  BaselineResult result;
  BenchPool src, dst;
  if (std::string e = src.Allocate(c, BenchPool::Fill::kPattern); !e.empty())
    return {"baseline: " + e};
  if (std::string e = dst.Allocate(c, BenchPool::Fill::kZero); !e.empty())
    return {"baseline: " + e};
  const auto runs = RequestRuns(c);
  const uint64_t item = c.item_bytes;
  auto copy = [&](uint64_t request) {
    for (uint64_t b = 0; b < src.buffers(); ++b) {
      const uint8_t* from = src.buffer(b);
      uint8_t* to = dst.buffer(b);
      for (const pdlib::PageRun& run : runs[request % runs.size()]) {
        std::memcpy(to + uint64_t(run.dst_start) * item, from + uint64_t(run.src_start) * item,
                    uint64_t(run.count) * item);
        result.bytes += uint64_t(run.count) * item;
        ++result.writes;
      }
    }
  };
  for (uint64_t i = 0; i < c.warmup; ++i) copy(i);
  result.bytes = result.writes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = c.warmup; i < c.warmup + c.requests; ++i) copy(i);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace pdlib_bench
