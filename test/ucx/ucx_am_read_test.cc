// The wire pieces of "am" reads (backends/ucx/ucx_am_read.h), tested without UCX: messages decode
// only when sizes, counts and magics are pdlib's, and a range is answered only when it is
// non-empty and inside the region it names, whatever addresses and lengths a peer sends.
#include "backends/ucx/ucx_am_read.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace ucx = pdlib::ucx;

namespace {

// A request message as an initiator sends it: header bytes and range bytes.
struct Message {
  std::vector<uint8_t> header;
  std::vector<uint8_t> data;
};

Message Encode(uint32_t count, uint64_t target, const std::vector<ucx::AmReadRange>& ranges) {
  const ucx::AmReadBatchHeader h{ucx::kAmReadBatchMagic, count, target};
  Message m;
  m.header.resize(sizeof(h));
  std::memcpy(m.header.data(), &h, sizeof(h));
  m.data.resize(ranges.size() * sizeof(ucx::AmReadRange));
  if (!ranges.empty()) std::memcpy(m.data.data(), ranges.data(), m.data.size());
  return m;
}

std::optional<std::vector<ucx::AmReadRequest>> Decode(const Message& m) {
  return ucx::DecodeAmReadBatch(m.header.data(), m.header.size(), m.data.data(), m.data.size());
}

}  // namespace

TEST_CASE("ucx am reads: a request message names many ranges and decodes only when well formed") {
  const std::vector<ucx::AmReadRange> ranges = {{7, 0, 99, 0x1000, 4096}, {8, 0, 100, 0x9000, 1}};
  Message m = Encode(2, 3, ranges);
  auto decoded = Decode(m);
  REQUIRE(decoded.has_value());
  REQUIRE(decoded->size() == 2);
  CHECK((*decoded)[0].region == 7);
  CHECK((*decoded)[0].target == 3);
  CHECK((*decoded)[0].cookie == 99);
  CHECK((*decoded)[0].addr == 0x1000);
  CHECK((*decoded)[0].length == 4096);
  CHECK((*decoded)[1].region == 8);
  CHECK((*decoded)[1].target == 3);
  CHECK((*decoded)[1].cookie == 100);
  // Unaligned data decodes the same.
  std::vector<uint8_t> shifted(m.data.size() + 1);
  std::memcpy(shifted.data() + 1, m.data.data(), m.data.size());
  auto unaligned =
      ucx::DecodeAmReadBatch(m.header.data(), m.header.size(), shifted.data() + 1, m.data.size());
  REQUIRE(unaligned.has_value());
  CHECK((*unaligned)[1].addr == 0x9000);

  // The count must match the data exactly, and lie in [1, kMaxAmReadRanges].
  CHECK_FALSE(Decode(Encode(3, 3, ranges)).has_value());
  CHECK_FALSE(Decode(Encode(1, 3, ranges)).has_value());
  CHECK_FALSE(Decode(Encode(0, 3, {})).has_value());
  const std::vector<ucx::AmReadRange> many(ucx::kMaxAmReadRanges + 1, {7, 0, 1, 0x1000, 1});
  CHECK_FALSE(Decode(Encode(ucx::kMaxAmReadRanges + 1, 3, many)).has_value());
  const std::vector<ucx::AmReadRange> most(ucx::kMaxAmReadRanges, {7, 0, 1, 0x1000, 1});
  CHECK(Decode(Encode(ucx::kMaxAmReadRanges, 3, most)).has_value());
  // Truncated data, a short header, no data, another magic.
  Message cut = m;
  cut.data.pop_back();
  CHECK_FALSE(Decode(cut).has_value());
  CHECK_FALSE(
      ucx::DecodeAmReadBatch(m.header.data(), m.header.size() - 1, m.data.data(), m.data.size())
          .has_value());
  CHECK_FALSE(
      ucx::DecodeAmReadBatch(m.header.data(), m.header.size(), nullptr, m.data.size()).has_value());
  Message other = m;
  other.header[0] ^= 1;
  CHECK_FALSE(Decode(other).has_value());
  // All ranges together at most kMaxAmReadRequestBytes, also when the sum would wrap around.
  const uint64_t half = ucx::kMaxAmReadRequestBytes / 2;
  CHECK(Decode(Encode(2, 3, {{7, 0, 1, 0, half}, {7, 0, 2, 0, half}})).has_value());
  CHECK_FALSE(Decode(Encode(2, 3, {{7, 0, 1, 0, half}, {7, 0, 2, 0, half + 1}})).has_value());
  CHECK_FALSE(Decode(Encode(2, 3, {{7, 0, 1, 0, 1}, {7, 0, 2, 0, UINT64_MAX}})).has_value());
}

TEST_CASE("ucx am reads: the initiator's limits on one request message match the target's") {
  CHECK(ucx::FitsAmReadBatch(0, 0, ucx::kMaxAmReadRequestBytes));
  CHECK_FALSE(ucx::FitsAmReadBatch(0, 0, ucx::kMaxAmReadRequestBytes + 1));
  CHECK(ucx::FitsAmReadBatch(ucx::kMaxAmReadRanges - 1, 0, 1));
  CHECK_FALSE(ucx::FitsAmReadBatch(ucx::kMaxAmReadRanges, 0, 1));
  CHECK(ucx::FitsAmReadBatch(3, ucx::kMaxAmReadRequestBytes - 1, 1));
  CHECK_FALSE(ucx::FitsAmReadBatch(3, ucx::kMaxAmReadRequestBytes - 1, 2));
  CHECK_FALSE(ucx::FitsAmReadBatch(3, ucx::kMaxAmReadRequestBytes, UINT64_MAX));
}

TEST_CASE("ucx am reads: reply headers decode only when size and magic match") {
  // A request message's header is not a reply header.
  const Message m = Encode(1, 3, {{7, 0, 99, 0x1000, 4096}});
  CHECK_FALSE(ucx::DecodeAmReadReply(m.header.data(), m.header.size()).has_value());

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
