// Page-index helpers (SPEC R5.1, R5.3): pure functions, no allocation unless noted.
#ifndef PDLIB_PAGE_INDEX_H_
#define PDLIB_PAGE_INDEX_H_

#include <cstdint>
#include <span>
#include <vector>

#include "pdlib/export.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// Number of pages that hold `num_tokens` tokens (a partial last page counts).
constexpr uint64_t PageCount(uint64_t num_tokens, uint32_t page_size) {
  return page_size == 0 ? 0 : (num_tokens + page_size - 1) / page_size;
}

// Maps a request's token slots (as a token-to-KV-pool mapping gives them, one per token, pages
// filled in order) to the page index of every page they touch: token_indices[k * page_size] /
// page_size for each k. Errors: page_size 0, a negative token index.
PDLIB_EXPORT StatusOr<std::vector<int32_t>> TokenIndicesToPageIndices(
    std::span<const int32_t> token_indices, uint32_t page_size);

// A run of `count` consecutive pages copied from src_start.. to dst_start.. .
struct PageRun {
  int32_t src_start;
  int32_t dst_start;
  int32_t count;
  friend bool operator==(const PageRun&, const PageRun&) = default;
};

// Merges (src[i], dst[i]) pairs into runs where both sides advance by one (SPEC R5.3), so that
// one write moves a whole run. Appends to *runs (cleared first); reuse the vector to avoid
// allocation. Errors: src and dst of different lengths.
PDLIB_EXPORT Status CoalescePageRuns(std::span<const int32_t> src, std::span<const int32_t> dst,
                                     std::vector<PageRun>* runs);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_PAGE_INDEX_H_
