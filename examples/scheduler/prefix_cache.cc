#include "examples/scheduler/prefix_cache.h"

#include <algorithm>
#include <string>

namespace pdlib::sched {

PrefixCache::PrefixCache(int32_t page_size, int32_t max_pages)
    : page_size_(std::max(1, page_size)), max_pages_(std::max(0, max_pages)) {}

uint64_t PrefixCache::KeyOf(uint64_t parent, std::span<const int32_t> page_tokens) {
  // FNV-1a over the parent key and the tokens, then a finalizer; 0 is kept for "no parent".
  uint64_t h = 0xcbf29ce484222325ull ^ parent;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(parent);
  for (int32_t t : page_tokens) mix(static_cast<uint32_t>(t));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h == 0 ? 1 : h;
}

PrefixCache::Match PrefixCache::Lookup(std::span<const int32_t> tokens, int64_t max_tokens) {
  Match m;
  ++lookups_;
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  uint64_t key = 0;
  for (int64_t at = 0; at + page_size_ <= limit; at += page_size_) {
    const auto page = tokens.subspan(static_cast<size_t>(at), static_cast<size_t>(page_size_));
    const uint64_t parent = key;
    key = KeyOf(parent, page);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.parent != parent ||
        !std::equal(page.begin(), page.end(), it->second.tokens.begin(), it->second.tokens.end())) {
      break;
    }
    Entry& e = it->second;
    if (e.locks++ == 0) lru_.erase(e.lru);
    m.pages.push_back(e.page);
  }
  m.tokens = static_cast<int64_t>(m.pages.size()) * page_size_;
  hits_ += m.pages.size();
  hit_tokens_ += static_cast<uint64_t>(m.tokens);
  return m;
}

Status PrefixCache::Unlock(std::span<const int32_t> pages) {
  for (int32_t page : pages) {
    auto k = key_of_page_.find(page);
    if (k == key_of_page_.end() || entries_.at(k->second).locks == 0) {
      return Status::FailedPrecondition("prefix cache: page " + std::to_string(page) +
                                        " unlocked but not locked");
    }
  }
  for (int32_t page : pages) {
    const uint64_t key = key_of_page_.at(page);
    Entry& e = entries_.at(key);
    if (--e.locks == 0) e.lru = lru_.insert(lru_.end(), key);
  }
  return Status::OK();
}

std::vector<size_t> PrefixCache::Insert(std::span<const int32_t> tokens,
                                        std::span<const int32_t> page_table,
                                        std::vector<int32_t>* evicted) {
  std::vector<size_t> adopted;
  uint64_t key = 0;
  const size_t full = std::min(page_table.size(), tokens.size() / static_cast<size_t>(page_size_));
  for (size_t i = 0; i < full; ++i) {
    const auto page =
        tokens.subspan(i * static_cast<size_t>(page_size_), static_cast<size_t>(page_size_));
    const uint64_t parent = key;
    key = KeyOf(parent, page);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      // Another sequence under the same key (a collision): leave it, cache nothing further.
      if (it->second.parent != parent ||
          !std::equal(page.begin(), page.end(), it->second.tokens.begin(),
                      it->second.tokens.end())) {
        break;
      }
      // Already cached (a borrowed page, or the same content from another request): refresh.
      if (it->second.locks == 0) lru_.splice(lru_.end(), lru_, it->second.lru);
      continue;
    }
    if (key_of_page_.contains(page_table[i])) continue;  // a cached page under another key
    if (cached_pages() >= max_pages_) Evict(cached_pages() - max_pages_ + 1, evicted);
    if (cached_pages() >= max_pages_) break;  // everything cached is locked: keep what we have
    Entry e;
    e.page = page_table[i];
    e.parent = parent;
    e.tokens.assign(page.begin(), page.end());
    e.lru = lru_.insert(lru_.end(), key);
    entries_.emplace(key, e);
    key_of_page_[e.page] = key;
    adopted.push_back(i);
  }
  return adopted;
}

void PrefixCache::Evict(int32_t count, std::vector<int32_t>* evicted) {
  while (count-- > 0 && !lru_.empty()) {
    const uint64_t key = lru_.front();
    lru_.pop_front();
    auto it = entries_.find(key);
    evicted->push_back(it->second.page);
    key_of_page_.erase(it->second.page);
    entries_.erase(it);
  }
}

std::vector<int32_t> PrefixCache::Clear() {
  std::vector<int32_t> pages;
  for (const auto& [key, e] : entries_) pages.push_back(e.page);
  entries_.clear();
  key_of_page_.clear();
  lru_.clear();
  return pages;
}

}  // namespace pdlib::sched
