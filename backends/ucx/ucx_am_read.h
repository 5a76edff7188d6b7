// The wire pieces of reads on pdlib's "am" data path (pull over tcp, or shared memory into
// memory UCX did not allocate), kept free of UCX calls so that they are unit-tested on their
// own (test/ucx/ucx_am_read_test.cc).
//
// The initiator (decode) names many ranges in one request message (AmReadBatchHeader, then
// `count` AmReadRange entries as the message's data): for each, the target's region id (from the
// key blob the target packed), the address and length it wants, and a cookie naming that range
// on the initiator. One message per range doubled the messages and system calls of a pull over
// tcp. The target (prefill) checks the connection and, range by range, the region and the
// bounds, then answers each range with reply messages of at most ucx.am_chunk_bytes, each naming
// the range's cookie and its offset in the range, or with one reply carrying a refusal. Headers
// travel in host byte order (UCX itself assumes both ends share one architecture).
#ifndef PDLIB_BACKENDS_UCX_UCX_AM_READ_H_
#define PDLIB_BACKENDS_UCX_UCX_AM_READ_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace pdlib {
inline namespace v1 {
namespace ucx {

inline constexpr uint32_t kAmReadRequestMagic = 0x52414450;  // "PDAR"
inline constexpr uint32_t kAmReadBatchMagic = 0x42414450;    // "PDAB"
inline constexpr uint32_t kAmReadReplyMagic = 0x44414450;    // "PDAD"
// The most one request message may ask for, all its ranges together: the target sends its
// replies from inside its handler, so a message bounds how much it queues at once (a hostile
// peer asking for gigabytes).
inline constexpr uint64_t kMaxAmReadRequestBytes = uint64_t{16} << 20;
// The most ranges one request message may name (8 KiB of entries).
inline constexpr uint32_t kMaxAmReadRanges = 256;

// One range of a request message as the target checks it, with the message's target id.
struct AmReadRequest {
  uint32_t magic = kAmReadRequestMagic;
  uint32_t region = 0;  // the target's id for the region (from its key blob)
  uint64_t target = 0;  // the target's id for the connection (from its endpoint blob)
  uint64_t cookie = 0;  // the initiator's id for this request; never reused
  uint64_t addr = 0;    // first byte wanted, in the target's address space
  uint64_t length = 0;
};
static_assert(sizeof(AmReadRequest) == 40);

// The header of a request message; its data is `count` AmReadRange entries.
struct AmReadBatchHeader {
  uint32_t magic = kAmReadBatchMagic;
  uint32_t count = 0;
  uint64_t target = 0;  // the target's id for the connection (from its endpoint blob)
};
static_assert(sizeof(AmReadBatchHeader) == 16);

// One range of a request message.
struct AmReadRange {
  uint32_t region = 0;  // the target's id for the region (from its key blob)
  uint32_t reserved = 0;
  uint64_t cookie = 0;  // the initiator's id for this range; never reused
  uint64_t addr = 0;    // first byte wanted, in the target's address space
  uint64_t length = 0;
};
static_assert(sizeof(AmReadRange) == 32);

struct AmReadReply {
  uint32_t magic = kAmReadReplyMagic;
  uint32_t status = 0;  // 0: the bytes follow; else why the target refused (UcxTransport::AmStatus)
  uint64_t cookie = 0;
  uint64_t offset = 0;  // of the data in the request
};
static_assert(sizeof(AmReadReply) == 24);

// Host memory that "am" messages may write and read: a registered region that is not written
// directly (UcxTransport::IsDirectRegion). Ids start at 1; 0 means "not on the am path".
struct AmRegion {
  uint32_t id = 0;
  uintptr_t addr = 0;
  uint64_t length = 0;
};

// Decodes a request message as it arrived (header and data; the data need not be aligned):
// nullopt unless the header's size and magic are pdlib's, it names 1 to kMaxAmReadRanges ranges,
// the data holds exactly that many entries and their lengths add up to at most
// kMaxAmReadRequestBytes. Each range must still pass FindReadableRange.
std::optional<std::vector<AmReadRequest>> DecodeAmReadBatch(const void* header,
                                                            size_t header_length, const void* data,
                                                            size_t length);
// Whether a range of `length` bytes may join a request message that already names `count`
// ranges of `bytes` in all (the initiator's side of DecodeAmReadBatch's limits).
bool FitsAmReadBatch(uint32_t count, uint64_t bytes, uint64_t length);

// Decodes a reply header as it arrived: nullopt when the size or the magic is not pdlib's.
std::optional<AmReadReply> DecodeAmReadReply(const void* header, size_t length);

// Whether [addr, addr + length) lies inside `region` (no overflow, length may be 0).
bool RangeInside(const AmRegion& region, uint64_t addr, uint64_t length);

// The region a read request may be answered from, or null: the region id must name a region in
// `regions` and the whole non-empty range, at most kMaxAmReadRequestBytes, must lie inside it.
const AmRegion* FindReadableRange(std::span<const AmRegion> regions, const AmReadRequest& request);

// Whether a reply of `length` bytes at `offset` fits a request of `request_length` bytes.
bool ReplyFits(uint64_t request_length, uint64_t offset, uint64_t length);

// How many reply messages answer `length` bytes with messages of at most `chunk` bytes.
uint64_t ReplyMessages(uint64_t length, uint64_t chunk);

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_AM_READ_H_
