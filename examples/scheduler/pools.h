// The memory pools a scheduler hands out (SPEC R9.1, R9.2):
//
//  - IndexAllocator: indices [0, capacity), lowest free first (so page runs stay contiguous and
//    every TP rank, making the same calls, gets the same answers). Used for state slots.
//  - PageAllocator: KV pages of page_size tokens; publishes KV events (kv_events.h).
//  - ReqToTokenPool: request slots, each holding one request's page table (the engine's
//    req_to_token mapping, at page granularity).
//  - DecodeReqToTokenPool: a ReqToTokenPool with pre_alloc_size slots beyond
//    max_running_requests, so requests being pre-allocated or transferred do not use up the
//    running batch's slots.
//
// Every free is checked (range, double free) and refused with a Status naming the index.
// Threads: none of these is thread-safe; the scheduler thread owns them.
#ifndef PDLIB_EXAMPLES_SCHEDULER_POOLS_H_
#define PDLIB_EXAMPLES_SCHEDULER_POOLS_H_

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "examples/scheduler/kv_events.h"
#include "pdlib/status.h"

namespace pdlib::sched {

class IndexAllocator {
 public:
  // `what` names the indices in error messages ("page", "request slot", ...).
  IndexAllocator(int32_t capacity, std::string what);

  std::optional<int32_t> Alloc();
  // Appends `count` indices to *out, or none (returns false) when fewer are free.
  bool AllocMany(int32_t count, std::vector<int32_t>* out);
  // kOutOfRange outside [0, capacity), kFailedPrecondition when not allocated.
  Status Free(int32_t index);

  int32_t capacity() const { return static_cast<int32_t>(in_use_.size()); }
  int32_t available() const { return static_cast<int32_t>(free_.size()); }
  bool in_use(int32_t index) const;

 private:
  std::string what_;
  std::set<int32_t> free_;
  std::vector<bool> in_use_;
};

class PageAllocator {
 public:
  // `events` (may be null) receives BlockStored/BlockRemoved/AllBlocksCleared; it must outlive
  // the allocator.
  PageAllocator(int32_t num_pages, int32_t page_size, KVEventSink* events = nullptr);

  // Appends `count` pages for `room` to *pages and publishes BlockStored; false (and nothing
  // allocated) when fewer than `count` pages are free.
  bool Alloc(int32_t count, uint64_t room, std::vector<int32_t>* pages);
  // Frees `pages` of `room` and publishes BlockRemoved. Every page is checked first; on error
  // nothing is freed.
  Status Free(std::span<const int32_t> pages, uint64_t room);
  // Frees every page and publishes AllBlocksCleared. Callers must drop their page tables.
  void Clear();

  int32_t num_pages() const { return pages_.capacity(); }
  int32_t page_size() const { return page_size_; }
  int32_t free_pages() const { return pages_.available(); }
  int64_t available_tokens() const { return int64_t{free_pages()} * page_size_; }
  int64_t capacity_tokens() const { return int64_t{num_pages()} * page_size_; }

 private:
  IndexAllocator pages_;
  int32_t page_size_;
  KVEventSink* events_;
};

class ReqToTokenPool {
 public:
  // `size` request slots whose page tables hold at most PageCount(max_context_len) pages.
  ReqToTokenPool(int32_t size, int32_t max_context_len, int32_t page_size);
  virtual ~ReqToTokenPool() = default;

  std::optional<int32_t> Alloc();
  // Clears the slot's page table (the caller frees the pages themselves).
  Status Free(int32_t slot);

  // The slot's page table; page i holds tokens [i * page_size, (i + 1) * page_size).
  std::vector<int32_t>& page_table(int32_t slot) { return tables_.at(static_cast<size_t>(slot)); }
  const std::vector<int32_t>& page_table(int32_t slot) const {
    return tables_.at(static_cast<size_t>(slot));
  }
  int32_t max_pages_per_request() const { return max_pages_; }

  int32_t size() const { return slots_.capacity(); }
  int32_t available() const { return slots_.available(); }

 private:
  IndexAllocator slots_;
  int32_t max_pages_;
  std::vector<std::vector<int32_t>> tables_;
};

// #running <= max_running_requests (the scheduler enforces it when it merges into the running
// batch); #prealloc + #transfer + #waiting use the pre_alloc_size extra slots, so pre-allocation
// can run ahead of decode without starving the running batch of slots.
class DecodeReqToTokenPool final : public ReqToTokenPool {
 public:
  DecodeReqToTokenPool(int32_t max_running_requests, int32_t pre_alloc_size,
                       int32_t max_context_len, int32_t page_size)
      : ReqToTokenPool(max_running_requests + pre_alloc_size, max_context_len, page_size),
        max_running_requests_(max_running_requests),
        pre_alloc_size_(pre_alloc_size) {}

  int32_t max_running_requests() const { return max_running_requests_; }
  int32_t pre_alloc_size() const { return pre_alloc_size_; }

 private:
  int32_t max_running_requests_;
  int32_t pre_alloc_size_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_POOLS_H_
