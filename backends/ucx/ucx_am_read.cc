#include "backends/ucx/ucx_am_read.h"

#include <cstring>

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

template <typename Header>
std::optional<Header> Decode(const void* bytes, size_t length, uint32_t magic) {
  Header h;
  if (bytes == nullptr || length != sizeof(h)) return std::nullopt;
  std::memcpy(&h, bytes, sizeof(h));
  if (h.magic != magic) return std::nullopt;
  return h;
}

}  // namespace

std::optional<std::vector<AmReadRequest>> DecodeAmReadBatch(const void* header,
                                                            size_t header_length, const void* data,
                                                            size_t length) {
  std::optional<AmReadBatchHeader> h =
      Decode<AmReadBatchHeader>(header, header_length, kAmReadBatchMagic);
  if (!h || h->count == 0 || h->count > kMaxAmReadRanges || data == nullptr ||
      length != size_t{h->count} * sizeof(AmReadRange)) {
    return std::nullopt;
  }
  std::vector<AmReadRequest> requests;
  requests.reserve(h->count);
  uint64_t total = 0;
  const auto* bytes = static_cast<const uint8_t*>(data);
  for (uint32_t i = 0; i < h->count; ++i) {
    AmReadRange range;
    std::memcpy(&range, bytes + size_t{i} * sizeof(range), sizeof(range));
    if (range.length > kMaxAmReadRequestBytes - total) return std::nullopt;
    total += range.length;
    requests.push_back(AmReadRequest{kAmReadRequestMagic, range.region, h->target, range.cookie,
                                     range.addr, range.length});
  }
  return requests;
}

bool FitsAmReadBatch(uint32_t count, uint64_t bytes, uint64_t length) {
  return count < kMaxAmReadRanges && bytes <= kMaxAmReadRequestBytes &&
         length <= kMaxAmReadRequestBytes - bytes;
}

std::optional<AmReadReply> DecodeAmReadReply(const void* header, size_t length) {
  return Decode<AmReadReply>(header, length, kAmReadReplyMagic);
}

bool RangeInside(const AmRegion& region, uint64_t addr, uint64_t length) {
  return addr >= region.addr && length <= region.length &&
         addr - region.addr <= region.length - length;
}

const AmRegion* FindReadableRange(std::span<const AmRegion> regions, const AmReadRequest& request) {
  if (request.region == 0 || request.length == 0 || request.length > kMaxAmReadRequestBytes) {
    return nullptr;
  }
  for (const AmRegion& region : regions) {
    if (region.id != request.region) continue;
    return RangeInside(region, request.addr, request.length) ? &region : nullptr;
  }
  return nullptr;
}

bool ReplyFits(uint64_t request_length, uint64_t offset, uint64_t length) {
  return offset <= request_length && length <= request_length - offset;
}

uint64_t ReplyMessages(uint64_t length, uint64_t chunk) {
  if (length == 0) return 0;
  if (chunk == 0) return 1;
  return (length - 1) / chunk + 1;
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
