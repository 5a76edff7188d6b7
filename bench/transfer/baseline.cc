#include "bench/transfer/baseline.h"

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "bench/transfer/bench_layout.h"
#include "bench/transfer/cuda_memory.h"

namespace pdlib_bench {

std::vector<std::vector<pdlib::PageRun>> RequestRuns(const BenchConfig& c) {
  const PageRing src(c, PrefillPageSeed(c)), dst(c, DecodePageSeed(c));
  std::vector<std::vector<pdlib::PageRun>> runs(src.slots());
  const uint64_t held = c.PrefixPages();  // --decode-prefix: only the pages after it move
  for (uint64_t i = 0; i < src.slots(); ++i) {
    pdlib::CoalescePageRuns(src.For(i).subspan(held), dst.For(i).subspan(held), &runs[i])
        .IgnoreError();  // same lengths
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

namespace {

// The device-to-device version (see baseline.h): the same runs, cudaMemcpyAsync on one stream.
BaselineResult RunCudaBaseline(const BenchConfig& c) {
  BaselineResult result;
  result.kind = "cudaMemcpy D2D";
  auto fail = [&](const std::string& e) {
    result.error = "baseline (cudaMemcpy D2D): " + e;
    return result;
  };
  BenchPool src, dst;
  if (std::string e = src.Allocate(c, BenchPool::Fill::kPattern, pdlib::Mode::kPrefill);
      !e.empty()) {
    return fail(e);
  }
  if (std::string e = dst.Allocate(c, BenchPool::Fill::kZero, pdlib::Mode::kDecode); !e.empty()) {
    return fail(e);
  }
  std::unique_ptr<CudaCopyStream> stream;
  if (std::string e = CudaCopyStream::Create(c.cuda_device, &stream); !e.empty()) return fail(e);
  const auto runs = RequestRuns(c);
  const uint64_t item = c.item_bytes;
  auto copy = [&](uint64_t request) -> std::string {
    for (uint64_t b = 0; b < src.buffers(); ++b) {
      for (const pdlib::PageRun& run : runs[request % runs.size()]) {
        const uint64_t n = uint64_t(run.count) * item;
        if (std::string e = stream->Copy(dst.buffer(b) + uint64_t(run.dst_start) * item,
                                         src.buffer(b) + uint64_t(run.src_start) * item, n);
            !e.empty()) {
          return e;
        }
        result.bytes += n;
        ++result.writes;
      }
    }
    return "";
  };
  for (uint64_t i = 0; i < c.warmup; ++i) {
    if (std::string e = copy(i); !e.empty()) return fail(e);
  }
  if (std::string e = stream->Synchronize(); !e.empty()) return fail(e);
  result.bytes = result.writes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = c.warmup; i < c.warmup + c.requests; ++i) {
    if (std::string e = copy(i); !e.empty()) return fail(e);
  }
  if (std::string e = stream->Synchronize(); !e.empty()) return fail(e);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The copies are checked like --verify checks pdlib's: the last measured request's pages.
  const uint64_t last = c.warmup + c.requests - 1;
  std::vector<uint8_t> got(item);
  for (uint64_t b = 0; b < src.buffers(); ++b) {
    for (const pdlib::PageRun& run : runs[last % runs.size()]) {
      for (int32_t k = 0; k < run.count; ++k) {
        if (std::string e = dst.Read(b, (uint64_t(run.dst_start) + k) * item, got); !e.empty()) {
          return fail(e);
        }
        if (!HoldsPattern(got.data(), item,
                          b * src.buffer_bytes() + (uint64_t(run.src_start) + k) * item)) {
          return fail("buffer " + std::to_string(b) + " page " + std::to_string(run.dst_start + k) +
                      " does not hold what was copied");
        }
      }
    }
  }
  return result;
}

}  // namespace

BaselineResult RunMemcpyBaseline(const BenchConfig& c) {
  if (c.memory == pdlib::MemoryKind::kCuda) return RunCudaBaseline(c);
  BaselineResult result;
  result.kind = "memcpy";
  BenchPool src, dst;
  for (auto [pool, fill, mode] :
       {std::tuple{&src, BenchPool::Fill::kPattern, pdlib::Mode::kPrefill},
        std::tuple{&dst, BenchPool::Fill::kZero, pdlib::Mode::kDecode}}) {
    if (std::string e = pool->Allocate(c, fill, mode); !e.empty()) {
      result.error = "baseline: " + e;
      return result;
    }
  }
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
