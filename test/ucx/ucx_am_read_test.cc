// The wire pieces of "am" reads (backends/ucx/ucx_am_read.h), tested without UCX: headers decode
// only when size and magic are pdlib's, and a read request is answered only for a non-empty range
// inside the region it names, whatever addresses and lengths a peer sends.
#include "backends/ucx/ucx_am_read.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ucx = pdlib::ucx;

TEST_CASE("ucx am reads: request and reply headers decode only when size and magic match") {
  const ucx::AmReadRequest request{ucx::kAmReadRequestMagic, 7, 3, 99, 0x1000, 4096};
  std::vector<uint8_t> bytes(sizeof(request));
  std::memcpy(bytes.data(), &request, sizeof(request));
  auto decoded = ucx::DecodeAmReadRequest(bytes.data(), bytes.size());
  REQUIRE(decoded.has_value());
  CHECK(decoded->region == 7);
  CHECK(decoded->target == 3);
  CHECK(decoded->cookie == 99);
  CHECK(decoded->addr == 0x1000);
  CHECK(decoded->length == 4096);
  CHECK_FALSE(ucx::DecodeAmReadRequest(bytes.data(), bytes.size() - 1).has_value());
  CHECK_FALSE(ucx::DecodeAmReadRequest(nullptr, bytes.size()).has_value());
  // A reply header is not a request, and the other way round.
  CHECK_FALSE(ucx::DecodeAmReadReply(bytes.data(), bytes.size()).has_value());

  const ucx::AmReadReply reply{ucx::kAmReadReplyMagic, 0, 99, 32768};
  std::vector<uint8_t> reply_bytes(sizeof(reply));
  std::memcpy(reply_bytes.data(), &reply, sizeof(reply));
  auto got = ucx::DecodeAmReadReply(reply_bytes.data(), reply_bytes.size());
  REQUIRE(got.has_value());
  CHECK(got->cookie == 99);
  CHECK(got->offset == 32768);
  reply_bytes[0] ^= 1;
  CHECK_FALSE(ucx::DecodeAmReadReply(reply_bytes.data(), reply_bytes.size()).has_value());
}

TEST_CASE("ucx am reads: a request is answered only inside the region it names") {
  const std::vector<ucx::AmRegion> regions = {{1, 0x10000, 0x1000}, {2, 0x40000, 0x8000}};
  auto find = [&](uint32_t region, uint64_t addr, uint64_t length) {
    return ucx::FindReadableRange(regions, {ucx::kAmReadRequestMagic, region, 1, 1, addr, length});
  };
  CHECK(find(1, 0x10000, 0x1000) == &regions[0]);           // all of it
  CHECK(find(2, 0x40000 + 0x7fff, 1) == &regions[1]);       // its last byte
  CHECK(find(1, 0x10000 + 0x800, 0x800) == &regions[0]);    // its second half
  CHECK(find(1, 0x10000 + 0x800, 0x801) == nullptr);        // one byte past the end
  CHECK(find(1, 0x10000 - 1, 2) == nullptr);                // one byte before the start
  CHECK(find(1, 0x40000, 16) == nullptr);                   // inside region 2, named as region 1
  CHECK(find(3, 0x10000, 16) == nullptr);                   // no such region
  CHECK(find(0, 0x10000, 16) == nullptr);                   // 0 is never a region
  CHECK(find(1, 0x10000, 0) == nullptr);                    // empty
  CHECK(find(1, 0x10000 + 16, UINT64_MAX - 8) == nullptr);  // addr + length wraps around
  CHECK(find(1, UINT64_MAX, 2) == nullptr);
  // Longer than a request may be, even inside a region.
  const std::vector<ucx::AmRegion> huge = {{5, 0, uint64_t{1} << 40}};
  CHECK(ucx::FindReadableRange(
            huge, {ucx::kAmReadRequestMagic, 5, 1, 1, 0, ucx::kMaxAmReadRequestBytes}) == &huge[0]);
  CHECK(ucx::FindReadableRange(huge, {ucx::kAmReadRequestMagic, 5, 1, 1, 0,
                                      ucx::kMaxAmReadRequestBytes + 1}) == nullptr);
}

TEST_CASE("ucx am reads: replies fit their request, and how many answer one") {
  CHECK(ucx::ReplyFits(65536, 0, 32768));
  CHECK(ucx::ReplyFits(65536, 32768, 32768));
  CHECK(ucx::ReplyFits(65536, 65536, 0));
  CHECK_FALSE(ucx::ReplyFits(65536, 32768, 32769));
  CHECK_FALSE(ucx::ReplyFits(65536, 65537, 0));
  CHECK_FALSE(ucx::ReplyFits(65536, UINT64_MAX, 2));
  CHECK(ucx::ReplyMessages(0, 32768) == 0);
  CHECK(ucx::ReplyMessages(1, 32768) == 1);
  CHECK(ucx::ReplyMessages(32768, 32768) == 1);
  CHECK(ucx::ReplyMessages(32769, 32768) == 2);
  CHECK(ucx::ReplyMessages(uint64_t{1} << 20, 5000) == 210);
}
