// pdlib-transfer-bench --baseline memcpy: the writes pdlib makes for a configuration, copied with
// memcpy by one thread of one process, to put pdlib's throughput next to what the memory system
// gives a plain copy.
//
// The writes are exactly pdlib's: the same pages for every request as the two ranks draw
// (PageRing, same seeds), coalesced into the same runs (pdlib::CoalescePageRuns, SPEC R5.3), for
// every K and V buffer (with --decode-prefix only the pages after the prefix, as pdlib sends),
// between two pools allocated like the ranks' (--pool-alloc). Timed like
// the ranks: `warmup` requests first, then the clock runs over the `requests` measured ones. The
// aux slot (a few hundred bytes per request) is not copied.
//
// With --memory cuda the pools are GPU memory on --cuda-device and each write is a
// device-to-device cudaMemcpyAsync on one stream, enqueued back to back and waited for once
// after the warm-up and once after the measured requests (the copies of many requests overlap
// their launches, as pdlib's requests in flight do): what the copy engines give the same writes.
#ifndef PDLIB_BENCH_TRANSFER_BASELINE_H_
#define PDLIB_BENCH_TRANSFER_BASELINE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench/transfer/bench_ranks.h"
#include "pdlib/page_index.h"

namespace pdlib_bench {

// The coalesced runs of each request of the page rings (index: request % PageRing slots).
std::vector<std::vector<pdlib::PageRun>> RequestRuns(const BenchConfig& c);

// The most frequent write length in bytes among `runs` (the message size a perftest comparison
// should use).
uint64_t TypicalWriteBytes(const BenchConfig& c,
                           const std::vector<std::vector<pdlib::PageRun>>& runs);

struct BaselineResult {
  std::string error;    // empty on success
  std::string kind;     // "memcpy" or "cudaMemcpy D2D"
  double seconds = 0;   // over the measured requests
  uint64_t bytes = 0;   // copied in the measured requests
  uint64_t writes = 0;  // copy calls in the measured requests
};

BaselineResult RunMemcpyBaseline(const BenchConfig& c);

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_BASELINE_H_
