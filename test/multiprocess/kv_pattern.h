// The byte pattern of the two-process byte-compare tests (pdlib_test_peer --verify): prefill fills
// every KV page it sends with bytes derived from (room, buffer index, page position in the
// request, byte offset), decode checks every byte of every destination page against the same
// formula. Pages are placed differently on each side, so a transfer that writes to the wrong
// offset, the wrong page, the wrong buffer or for the wrong room fails the check.
//
// Header-only, no dependencies beyond the standard library: used by peer_main.cc and by
// ucx_multiprocess_test.cc (which checks that the verifier does catch a flipped byte).
#ifndef PDLIB_TEST_MULTIPROCESS_KV_PATTERN_H_
#define PDLIB_TEST_MULTIPROCESS_KV_PATTERN_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace pdlib_test {

// SplitMix64's finaliser: a cheap bijective mix of 64 bits.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The seed of one page: distinct for every (room, buffer, position) in practice.
inline uint64_t PageSeed(uint64_t room, uint32_t buffer, uint32_t page_pos) {
  return Mix64(Mix64(room * 0x100000001b3ULL + 0x5eedULL) ^ (uint64_t(buffer) << 32) ^ page_pos);
}

// The 8 pattern bytes at byte offsets [8 * word, 8 * word + 8) of a page with `seed`.
inline uint64_t PatternWord(uint64_t seed, uint64_t word) { return Mix64(seed + word); }

// The expected byte at `offset` of page `page_pos` of buffer `buffer` of `room`.
inline uint8_t PatternByte(uint64_t room, uint32_t buffer, uint32_t page_pos, uint64_t offset) {
  const uint64_t w = PatternWord(PageSeed(room, buffer, page_pos), offset / 8);
  uint8_t bytes[8];
  std::memcpy(bytes, &w, 8);
  return bytes[offset % 8];
}

// Fills `len` bytes at `dst` with the pattern of (room, buffer, page_pos).
inline void FillPage(uint8_t* dst, size_t len, uint64_t room, uint32_t buffer, uint32_t page_pos) {
  const uint64_t seed = PageSeed(room, buffer, page_pos);
  size_t off = 0;
  for (uint64_t word = 0; off < len; ++word, off += 8) {
    const uint64_t w = PatternWord(seed, word);
    std::memcpy(dst + off, &w, std::min<size_t>(8, len - off));
  }
}

// Checks `len` bytes at `src` against the pattern. nullopt when every byte matches, otherwise a
// description of the first mismatch (one token, no spaces).
inline std::optional<std::string> VerifyPage(const uint8_t* src, size_t len, uint64_t room,
                                             uint32_t buffer, uint32_t page_pos) {
  const uint64_t seed = PageSeed(room, buffer, page_pos);
  size_t off = 0;
  for (uint64_t word = 0; off < len; ++word, off += 8) {
    const uint64_t w = PatternWord(seed, word);
    const size_t n = std::min<size_t>(8, len - off);
    if (std::memcmp(src + off, &w, n) == 0) continue;
    uint8_t expected[8];
    std::memcpy(expected, &w, 8);
    for (size_t i = 0; i < n; ++i) {
      if (src[off + i] == expected[i]) continue;
      char buf[160];
      std::snprintf(buf, sizeof(buf), "buffer=%u,page_pos=%u,offset=%zu,expected=0x%02x,got=0x%02x",
                    buffer, page_pos, off + i, unsigned(expected[i]), unsigned(src[off + i]));
      return std::string(buf);
    }
  }
  return std::nullopt;
}

// The pattern of state slot n of state buffer s is that of "buffer" kStatePatternBase + s at
// position n: far from any KV buffer index, so a state slot never matches a KV page's pattern.
inline constexpr uint32_t kStatePatternBase = 1u << 30;

// The aux slot's output_ids[0] of `room` (its bootstrap_room field holds the room itself).
inline int32_t AuxOutputId(uint64_t room) { return int32_t(Mix64(room ^ 0xa0c5ULL) % 32000); }

// Per-room shape of a request in --verify mode, derived from the room id alone so that both
// sides agree on it. With `vary`, the page count, placement and chunk count vary per room up to
// the given maxima; otherwise they are the maxima themselves.
struct RoomShape {
  size_t pages = 1;
  bool scattered = true;
  size_t chunks = 1;
};

inline RoomShape ShapeOf(uint64_t room, size_t max_pages, bool scattered, size_t max_chunks,
                         bool vary) {
  RoomShape s;
  s.pages = max_pages;
  s.scattered = scattered;
  s.chunks = max_chunks;
  if (vary) {
    const uint64_t h = Mix64(room ^ 0x5a9eULL);
    s.pages = 1 + size_t(h % max_pages);
    s.scattered = ((h >> 32) & 1) != 0;
    s.chunks = 1 + size_t((h >> 40) % max_chunks);
  }
  s.chunks = std::max<size_t>(1, std::min(s.chunks, s.pages));
  return s;
}

// The number of pages in chunk `c` of `shape`: whole pages, the remainder in the last chunk.
inline size_t ChunkPages(const RoomShape& shape, size_t c) {
  const size_t base = shape.pages / shape.chunks;
  return c + 1 < shape.chunks ? base : shape.pages - base * (shape.chunks - 1);
}

// Pages of a pool of `pool` pages handed out to the requests in flight, as an engine would:
// scattered requests get random free pages, contiguous ones a run of consecutive free pages.
// `salt` makes prefill and decode choose different pages for the same room.
class PagePool {
 public:
  PagePool(size_t pool, uint64_t salt) : used_(pool, false), salt_(salt) {}

  // `count` free pages for `room`, or nullopt when none fit right now.
  std::optional<std::vector<int32_t>> Alloc(uint64_t room, size_t count, bool scattered) {
    const size_t pool = used_.size();
    if (count == 0 || count > pool - in_use_) return std::nullopt;
    uint64_t h = Mix64(room ^ salt_);
    std::vector<int32_t> out;
    out.reserve(count);
    if (scattered) {
      std::vector<int32_t> free;
      free.reserve(pool - in_use_);
      for (size_t i = 0; i < pool; ++i) {
        if (!used_[i]) free.push_back(int32_t(i));
      }
      for (size_t i = 0; i < count; ++i) {  // partial Fisher-Yates
        h = Mix64(h);
        const size_t j = i + size_t(h % (free.size() - i));
        std::swap(free[i], free[j]);
        out.push_back(free[i]);
      }
    } else {
      const size_t starts = pool - count + 1;  // every start where the run fits
      const size_t start = size_t(h % starts);
      for (size_t k = 0; k < starts && out.empty(); ++k) {
        const size_t first = (start + k) % starts;
        bool fits = true;
        for (size_t i = first; i < first + count && fits; ++i) fits = !used_[i];
        if (!fits) continue;
        for (size_t i = first; i < first + count; ++i) out.push_back(int32_t(i));
      }
      if (out.empty()) return std::nullopt;
    }
    for (int32_t p : out) used_[size_t(p)] = true;
    in_use_ += out.size();
    return out;
  }

  void Free(const std::vector<int32_t>& pages) {
    for (int32_t p : pages) {
      if (used_[size_t(p)]) --in_use_;
      used_[size_t(p)] = false;
    }
  }

 private:
  std::vector<bool> used_;
  size_t in_use_ = 0;
  uint64_t salt_;
};

}  // namespace pdlib_test

#endif  // PDLIB_TEST_MULTIPROCESS_KV_PATTERN_H_
