// What pdlib-chaos's prefill and decode processes agree on about a request without talking:
// its shape (pages, chunks, placement, when decode calls Init, the decode prefix, the state
// windows) and the bytes prefill writes, all derived from the room id. Decode checks every byte
// of every destination page, state item and the aux slot against the same formulas, so a write
// that lands on the wrong page, buffer, offset, position or room, or a stale write of an earlier
// request, is caught.
//
// Pure functions and a page allocator; no I/O, no threads.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_PATTERN_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/metadata_buffers.h"
#include "pdlib/types.h"

namespace pdlib_chaos {

// A bijective 64-bit mix (the finaliser of SplitMix64).
uint64_t Mix(uint64_t x);

// Tokens per KV page on both sides (KVArgs::page_size).
inline constexpr uint64_t kPageTokens = 16;

// Window pages of a swa state family at most (prefill's window is 1..3 pages, decode's one more
// or less at times): sizes the swa pools.
inline constexpr size_t kMaxWindowPages = 4;

// How one request looks on both sides.
struct RequestShape {
  size_t pages = 1;  // KV pages of the whole prompt (decode's prefix pages included)
  // Decode prefix reuse: the first `prefix_pages` pages of the prompt are in decode's cache
  // already; decode hands over the pages after them and prefill sends only those. 0: none;
  // `pages`: the whole prompt (prefill sends one empty last chunk with aux and state).
  size_t prefix_pages = 0;
  // Tokens of the prompt: the last page may be partial, except when the prefix covers every
  // page (a prefix is whole pages and never longer than the prompt).
  uint64_t prompt_tokens = kPageTokens;
  size_t chunks = 1;        // Send() calls on prefill (the last one takes the remainder)
  bool contiguous = false;  // decode asks for a run of consecutive pages (else scattered)
  bool early_init = false;  // decode calls Init() at once, while still Bootstrapping
  // Swa window pages each side hands over (state families of kind swa): prefill's 1..3 (at most
  // the prompt's pages), decode's the same or one page apart (the drift pdlib allows; the first
  // min(swa_prefill, swa_decode) entries pair up).
  size_t swa_prefill = 1;
  size_t swa_decode = 1;
};

// The shape of `room`: pages in [1, max_pages]; with probability `prefix_share` (by a hash of
// the room) a decode prefix of 1..pages pages; chunks in [1, min(sent pages, max_chunks)] (1
// when the prefix covers the prompt). With prefix_share 0 the shape is the one it always was.
RequestShape ShapeOf(uint64_t room, size_t max_pages, size_t max_chunks, double prefix_share = 0);

// KV pages prefill sends in push: those after decode's prefix.
inline size_t SentPages(const RequestShape& shape) { return shape.pages - shape.prefix_pages; }

// KV pages prefill publishes in pull: every page of the prompt, whatever decode's prefix (decode
// reads only those after it; KVSender::PagesAfterPrefix in pull). The prompt's pages in push.
inline size_t PublishedPages(const RequestShape& shape, pdlib::TransferDirection direction) {
  return direction == pdlib::TransferDirection::kPull ? shape.pages : SentPages(shape);
}

// Pages of chunk `chunk` of `shape`: whole pages of the sent ones (push) or of every page of the
// prompt (pull); the last chunk takes what is left (0 in push when the prefix covers the
// prompt). The chunk count is the shape's either way.
size_t ChunkPages(const RequestShape& shape, size_t chunk,
                  pdlib::TransferDirection direction = pdlib::TransferDirection::kPush);

// Buffer ids of the byte pattern (FillPage's `buffer`): KV buffers are 0..2L-1; state family f's
// buffer l is StateBufferId(f, l); the bytes decode keeps in the pages of its own prefix (its
// cache, which pdlib must never write) are those of PrefixBufferId(kv buffer).
inline uint32_t StateBufferId(size_t family, size_t buffer) {
  return uint32_t(0x10000 * (family + 1) + buffer);
}
inline uint32_t PrefixBufferId(size_t kv_buffer) { return uint32_t(0x800000 + kv_buffer); }

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

// State families by name (--state-families): "mamba,swa", or "none" for no family.
std::string StateFamiliesName(const std::vector<pdlib::StateType>& families);
// Parses StateFamiliesName's text (mamba, swa, c128_state, repeats allowed, or none); false with
// the reason in *error for anything else.
bool ParseStateFamilies(std::string_view text, std::vector<pdlib::StateType>* out,
                        std::string* error);

// The items of one pool (KV pages, state slots or window pages) handed out to the requests in
// flight, as an engine's allocator would: scattered requests get pseudo-random free items,
// contiguous ones a run of consecutive free items (scattered when no run is free). `salt` makes
// the two sides pick differently.
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
