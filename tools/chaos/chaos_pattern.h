// What pdlib-chaos's prefill and decode processes agree on about a request without talking:
// its shape (pages, chunks, placement, when decode calls Init) and the bytes prefill writes,
// all derived from the room id. Decode checks every byte of every destination page and the aux
// slot against the same formulas, so a write that lands on the wrong page, buffer, offset or
// room, or a stale write of an earlier request, is caught.
//
// Pure functions and a page allocator; no I/O, no threads.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_PATTERN_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pdlib/metadata_buffers.h"

namespace pdlib_chaos {

// A bijective 64-bit mix (the finaliser of SplitMix64).
uint64_t Mix(uint64_t x);

// How one request looks on both sides.
struct RequestShape {
  size_t pages = 1;         // KV pages of the request
  size_t chunks = 1;        // Send() calls on prefill (the last one takes the remainder)
  bool contiguous = false;  // decode asks for a run of consecutive pages (else scattered)
  bool early_init = false;  // decode calls Init() at once, while still Bootstrapping
};

// The shape of `room`: pages in [1, max_pages], chunks in [1, min(pages, max_chunks)].
RequestShape ShapeOf(uint64_t room, size_t max_pages, size_t max_chunks);

// Pages of chunk `chunk` of `shape`: whole pages; the last chunk takes what is left.
size_t ChunkPages(const RequestShape& shape, size_t chunk);

// Fills `len` bytes at `dst` with the pattern of (room, buffer, page position in the request).
void FillPage(uint8_t* dst, size_t len, uint64_t room, uint32_t buffer, uint32_t position);

// nullopt when the `len` bytes at `src` hold the pattern of (room, buffer, position); otherwise
// the first wrong byte, as one token ("buffer=1,position=2,offset=40,expected=0x1f,got=0x00").
std::optional<std::string> CheckPage(const uint8_t* src, size_t len, uint64_t room, uint32_t buffer,
                                     uint32_t position);

// The metadata slot prefill writes for `room`: every field filled from the room id, with
// bootstrap_room[0] = room (what pdlib itself checks, SPEC R4.4). No hidden states.
pdlib::MetadataSlot AuxSlotOf(uint64_t room);
// Bytes of a slot that CheckAuxSlot compares.
size_t AuxSlotBytes();
// nullopt when `got` is AuxSlotOf(room); otherwise the first wrong field, as one token.
std::optional<std::string> CheckAuxSlot(const pdlib::MetadataSlot& got, uint64_t room);

// The pages of one KV pool handed out to the requests in flight, as an engine's allocator
// would: scattered requests get pseudo-random free pages, contiguous ones a run of consecutive
// free pages (scattered when no run is free). `salt` makes the two sides pick differently.
class PagePool {
 public:
  PagePool(size_t pages, uint64_t salt);

  // `count` pages for `room`, or nullopt when fewer than `count` are free.
  std::optional<std::vector<int32_t>> Alloc(uint64_t room, size_t count, bool contiguous);
  void Free(const std::vector<int32_t>& pages);

  size_t capacity() const { return used_.size(); }
  bool in_use(size_t page) const { return page < used_.size() && used_[page]; }
  size_t available() const { return used_.size() - in_use_; }

 private:
  std::vector<bool> used_;
  size_t in_use_ = 0;
  uint64_t salt_;
};

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_PATTERN_H_
