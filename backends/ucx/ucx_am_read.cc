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

std::optional<AmReadRequest> DecodeAmReadRequest(const void* header, size_t length) {
  return Decode<AmReadRequest>(header, length, kAmReadRequestMagic);
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
