#include "tools/chaos/chaos_pattern.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace pdlib_chaos {
namespace {

uint64_t PageSeed(uint64_t room, uint32_t buffer, uint32_t position) {
  return Mix(Mix(room ^ 0x6368616f73ULL) + (uint64_t{buffer} << 32 | position));
}

}  // namespace

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

RequestShape ShapeOf(uint64_t room, size_t max_pages, size_t max_chunks, double prefix_share) {
  const uint64_t h = Mix(room ^ 0x73686170ULL);
  RequestShape s;
  s.pages = 1 + size_t(h % std::max<size_t>(1, max_pages));
  s.chunks = 1 + size_t((h >> 24) % std::max<size_t>(1, max_chunks));
  s.contiguous = ((h >> 48) & 1) != 0;
  s.early_init = ((h >> 49) & 1) != 0;
  // The prefix and the windows from a second hash, so that the old fields keep their values.
  const uint64_t g = Mix(room ^ 0x707265666978ULL);
  const double u = double(g >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  if (u < prefix_share) s.prefix_pages = 1 + size_t((g & 0xffff) % s.pages);
  const uint64_t partial = (g >> 16) % kPageTokens;  // tokens short of a full last page
  s.prompt_tokens = s.pages * kPageTokens - (s.prefix_pages == s.pages ? 0 : partial);
  s.chunks = std::max<size_t>(1, std::min(s.chunks, SentPages(s)));
  s.swa_prefill = std::min<size_t>(s.pages, 1 + (g >> 24) % 3);
  switch ((g >> 28) % 4) {  // decode's window: one page more, one less, or the same (twice)
    case 0: s.swa_decode = std::min(s.pages, s.swa_prefill + 1); break;
    case 1: s.swa_decode = std::max<size_t>(1, s.swa_prefill - 1); break;
    default: s.swa_decode = s.swa_prefill; break;
  }
  return s;
}

size_t ChunkPages(const RequestShape& shape, size_t chunk, pdlib::TransferDirection direction) {
  const size_t sent = PublishedPages(shape, direction);
  const size_t base = sent / shape.chunks;
  return chunk + 1 < shape.chunks ? base : sent - base * (shape.chunks - 1);
}

void FillPage(uint8_t* dst, size_t len, uint64_t room, uint32_t buffer, uint32_t position) {
  const uint64_t seed = PageSeed(room, buffer, position);
  for (size_t off = 0, word = 0; off < len; off += 8, ++word) {
    const uint64_t w = Mix(seed + word);
    std::memcpy(dst + off, &w, std::min<size_t>(8, len - off));
  }
}

std::optional<std::string> CheckPage(const uint8_t* src, size_t len, uint64_t room, uint32_t buffer,
                                     uint32_t position) {
  const uint64_t seed = PageSeed(room, buffer, position);
  for (size_t off = 0, word = 0; off < len; off += 8, ++word) {
    const uint64_t w = Mix(seed + word);
    const size_t n = std::min<size_t>(8, len - off);
    if (std::memcmp(src + off, &w, n) == 0) continue;
    uint8_t want[8];
    std::memcpy(want, &w, 8);
    for (size_t i = 0; i < n; ++i) {
      if (src[off + i] == want[i]) continue;
      char text[128];
      std::snprintf(text, sizeof(text),
                    "buffer=%u,position=%u,offset=%zu,expected=0x%02x,got=0x%02x", buffer, position,
                    off + i, unsigned{want[i]}, unsigned{src[off + i]});
      return std::string(text);
    }
  }
  return std::nullopt;
}

namespace {

// Element `i` of field `field` of the slot of `room`: small integers, exact as float too.
template <typename T, size_t N>
void FillField(std::array<T, N>* out, uint64_t room, int field) {
  for (size_t i = 0; i < N; ++i) {
    (*out)[i] = T(Mix(room * 0x100 + uint64_t(field) * 0x10000 + i) % 1000000);
  }
}

template <typename T, size_t N>
std::optional<std::string> CompareField(const char* name, const std::array<T, N>& got,
                                        const std::array<T, N>& want) {
  for (size_t i = 0; i < N; ++i) {
    if (got[i] == want[i]) continue;
    std::ostringstream out;
    out << "aux." << name << "[" << i << "]=" << got[i] << ",expected=" << want[i];
    return out.str();
  }
  return std::nullopt;
}

}  // namespace

pdlib::MetadataSlot AuxSlotOf(uint64_t room) {
  pdlib::MetadataSlot s;
  FillField(&s.output_ids, room, 0);
  FillField(&s.cached_tokens, room, 1);
  FillField(&s.output_token_logprobs_val, room, 2);
  FillField(&s.output_token_logprobs_idx, room, 3);
  FillField(&s.output_top_logprobs_val, room, 4);
  FillField(&s.output_top_logprobs_idx, room, 5);
  FillField(&s.output_topk_p, room, 6);
  FillField(&s.output_topk_index, room, 7);
  FillField(&s.bootstrap_room, room, 9);
  s.bootstrap_room[0] = room;
  return s;
}

size_t AuxSlotBytes() {
  const pdlib::MetadataSlot s;
  return sizeof(s.output_ids) + sizeof(s.cached_tokens) + sizeof(s.output_token_logprobs_val) +
         sizeof(s.output_token_logprobs_idx) + sizeof(s.output_top_logprobs_val) +
         sizeof(s.output_top_logprobs_idx) + sizeof(s.output_topk_p) + sizeof(s.output_topk_index) +
         sizeof(s.bootstrap_room);
}

std::optional<std::string> CheckAuxSlot(const pdlib::MetadataSlot& got, uint64_t room) {
  const pdlib::MetadataSlot want = AuxSlotOf(room);
  // bootstrap_room first: a slot of another request names that request.
  if (auto bad = CompareField("bootstrap_room", got.bootstrap_room, want.bootstrap_room)) {
    return bad;
  }
  if (auto bad = CompareField("output_ids", got.output_ids, want.output_ids)) return bad;
  if (auto bad = CompareField("cached_tokens", got.cached_tokens, want.cached_tokens)) return bad;
  if (auto bad = CompareField("output_token_logprobs_val", got.output_token_logprobs_val,
                              want.output_token_logprobs_val)) {
    return bad;
  }
  if (auto bad = CompareField("output_token_logprobs_idx", got.output_token_logprobs_idx,
                              want.output_token_logprobs_idx)) {
    return bad;
  }
  if (auto bad = CompareField("output_top_logprobs_val", got.output_top_logprobs_val,
                              want.output_top_logprobs_val)) {
    return bad;
  }
  if (auto bad = CompareField("output_top_logprobs_idx", got.output_top_logprobs_idx,
                              want.output_top_logprobs_idx)) {
    return bad;
  }
  if (auto bad = CompareField("output_topk_p", got.output_topk_p, want.output_topk_p)) return bad;
  return CompareField("output_topk_index", got.output_topk_index, want.output_topk_index);
}

std::string StateFamiliesName(const std::vector<pdlib::StateType>& families) {
  if (families.empty()) return "none";
  std::string out;
  for (pdlib::StateType t : families) {
    out += (out.empty() ? "" : ",") + std::string(pdlib::StateTypeName(t));
  }
  return out;
}

bool ParseStateFamilies(std::string_view text, std::vector<pdlib::StateType>* out,
                        std::string* error) {
  out->clear();
  if (text == "none") return true;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view name = text.substr(at, comma - at);
    bool known = false;
    for (pdlib::StateType t :
         {pdlib::StateType::kMamba, pdlib::StateType::kSwa, pdlib::StateType::kC128State}) {
      if (name == pdlib::StateTypeName(t)) {
        out->push_back(t);
        known = true;
      }
    }
    if (!known) {
      *error = "unknown state family '" + std::string(name) +
               "' (mamba, swa and c128_state, a comma list; or none)";
      return false;
    }
    at = comma + 1;
  }
  return true;
}

PagePool::PagePool(size_t pages, uint64_t salt) : used_(pages, false), salt_(salt) {}

std::optional<std::vector<int32_t>> PagePool::Alloc(uint64_t room, size_t count, bool contiguous) {
  const size_t pool = used_.size();
  if (count == 0 || count > available()) return std::nullopt;
  uint64_t h = Mix(room ^ salt_);
  std::vector<int32_t> out;
  out.reserve(count);
  if (contiguous) {
    // Every start where a run of `count` fits, tried from a room-dependent one.
    const size_t starts = pool - count + 1;
    const size_t from = size_t(h % starts);
    for (size_t k = 0; k < starts && out.empty(); ++k) {
      const size_t first = (from + k) % starts;
      if (std::all_of(used_.begin() + std::ptrdiff_t(first),
                      used_.begin() + std::ptrdiff_t(first + count), [](bool u) { return !u; })) {
        for (size_t i = first; i < first + count; ++i) out.push_back(int32_t(i));
      }
    }
  }
  if (out.empty()) {
    std::vector<int32_t> free;
    free.reserve(available());
    for (size_t i = 0; i < pool; ++i) {
      if (!used_[i]) free.push_back(int32_t(i));
    }
    for (size_t i = 0; i < count; ++i) {  // the first `count` of a partial shuffle
      h = Mix(h);
      std::swap(free[i], free[i + size_t(h % (free.size() - i))]);
      out.push_back(free[i]);
    }
  }
  for (int32_t p : out) used_[size_t(p)] = true;
  in_use_ += out.size();
  return out;
}

void PagePool::Free(const std::vector<int32_t>& pages) {
  for (int32_t p : pages) {
    if (p < 0 || size_t(p) >= used_.size() || !used_[size_t(p)]) continue;
    used_[size_t(p)] = false;
    --in_use_;
  }
}

}  // namespace pdlib_chaos
