// PrefixCache: the decode side's cache of finished requests' KV pages, for decode prefix reuse
// (issue #27, SPEC R11.1): when a new request's prompt starts with tokens whose KV decode still
// holds (a multi-turn chat: the next prompt is the previous one plus its output plus new
// tokens), decode hands prefill only the pages after them and tells pdlib how long its prefix is.
//
// A page-hash table, the simplest form of SGLang's radix cache: each full page of a token
// sequence has a key that chains the previous page's key with the page's tokens, so the same
// page content at the same position after the same history gets the same key. Match() walks a
// prompt's pages while their keys are cached and locks them (the request's page table then
// borrows them, read-only: a prefix is whole pages, so no later token is written into them);
// Insert() adopts a finished request's full pages whose keys are new; Unlock() gives borrowed
// pages back; unlocked pages are evicted least recently used first, and handed back to the page
// allocator by the caller.
//
// Only KV without per-request state can be reused this way: a hybrid model's recurrent state
// (or a sliding window's) at the prefix is not cached, so the hosts refuse the cache for them.
//
// Not thread-safe: the scheduler thread owns it. Every TP rank of a host makes the same calls
// with the same tokens and page ids, so every rank matches the same prefix.
#ifndef PDLIB_EXAMPLES_SCHEDULER_PREFIX_CACHE_H_
#define PDLIB_EXAMPLES_SCHEDULER_PREFIX_CACHE_H_

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::sched {

class PrefixCache {
 public:
  // Pages of `page_size` tokens; at most `max_pages` cached (older unlocked ones are evicted to
  // make room; Insert adopts fewer when every cached page is locked).
  PrefixCache(int32_t page_size, int32_t max_pages);

  struct Match {
    std::vector<int32_t> pages;  // locked; the request's first pages
    int64_t tokens = 0;          // pages.size() * page_size
  };
  // The longest run of cached full pages at the start of tokens[0, max_tokens), locked.
  Match Lookup(std::span<const int32_t> tokens, int64_t max_tokens);
  // Gives back pages Lookup locked (once each). kFailedPrecondition for a page not locked.
  Status Unlock(std::span<const int32_t> pages);
  // Offers a finished request's first full pages: `tokens` are the tokens whose KV the pages
  // hold (at least pages.size() * page_size of them), page_table[i] holds page i. Returns the
  // positions in page_table whose pages the cache now owns (the caller must not free them);
  // pages already cached (borrowed ones, or the same content from another request) are not
  // taken. Pages evicted to make room are appended to *evicted (free them).
  std::vector<size_t> Insert(std::span<const int32_t> tokens, std::span<const int32_t> page_table,
                             std::vector<int32_t>* evicted);
  // Evicts up to `count` unlocked pages, least recently used first, into *evicted.
  void Evict(int32_t count, std::vector<int32_t>* evicted);
  // Every cached page (for shutdown); the cache is empty afterwards. Locked pages included:
  // the caller is tearing down the requests that borrow them too.
  std::vector<int32_t> Clear();

  int32_t cached_pages() const { return static_cast<int32_t>(entries_.size()); }
  int32_t evictable_pages() const { return static_cast<int32_t>(lru_.size()); }
  int32_t page_size() const { return page_size_; }
  uint64_t hits() const { return hits_; }              // pages matched by Lookup, ever
  uint64_t lookups() const { return lookups_; }        // Lookup calls
  uint64_t hit_tokens() const { return hit_tokens_; }  // tokens matched by Lookup, ever

 private:
  struct Entry {
    int32_t page = -1;
    // What the key stands for, compared on every hit: a hash collision never returns another
    // sequence's KV.
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    int32_t locks = 0;
    std::list<uint64_t>::iterator lru;  // in lru_ while locks == 0
  };
  // The key of the page holding `page_tokens`, after the page whose key is `parent` (0: first).
  static uint64_t KeyOf(uint64_t parent, std::span<const int32_t> page_tokens);

  int32_t page_size_;
  int32_t max_pages_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::unordered_map<int32_t, uint64_t> key_of_page_;
  std::list<uint64_t> lru_;  // unlocked keys, least recently used first
  uint64_t hits_ = 0, lookups_ = 0, hit_tokens_ = 0;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_PREFIX_CACHE_H_
