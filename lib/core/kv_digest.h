// The KV integrity digest (SPEC R12.3, docs/reliability.md "KV integrity"): what one prefill rank
// moved to one decode rank for one room, and what landed there, in a form both sides compute
// independently.
//
// Cells: every item a room moves is one cell: a KV page of one decode KV buffer (one layer's K
// or V), the aux row of one aux buffer, a state slot of one state buffer. A cell's value is the
// raw CRC32C of the item's bytes as decode holds them (lib/base/crc32c.h), multiplied by a key
// drawn from the cell's place (kind, decode buffer, decode index): so moving bytes to the wrong
// page or buffer changes the digest even when the bytes themselves are intact.
//
// Several prefill ranks may fill one decode item (M:N TP: each its heads). Each computes the
// raw CRC of its own byte ranges with zeros elsewhere, without reading the zeros; the raw CRC is
// linear, so the XOR of the senders' values is the value of the whole item. Decode XORs what
// its senders sent and compares with its own pass over what landed.
//
// What travels (KvDigest): the cell values folded, by XOR, into rows and columns: one row per
// decode KV buffer, one column per group of request pages (at most kMaxDigestColumns), one
// value per aux buffer and per state buffer. A mismatch is narrowed to the rows (layers) and
// columns (page ranges) it shows in. A few hundred bytes per room whatever its length.
#ifndef PDLIB_LIB_CORE_KV_DIGEST_H_
#define PDLIB_LIB_CORE_KV_DIGEST_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lib/planner/planner.h"
#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

inline constexpr uint32_t kMaxDigestColumns = 64;

// Request pages (after decode's prefix) per digest column.
uint32_t DigestPageGroup(uint64_t pages);

struct KvDigest {
  uint32_t page_group = 1;      // request pages per column
  std::vector<uint32_t> kv;     // per decode KV buffer
  std::vector<uint32_t> pages;  // per column: request pages [c * page_group, (c + 1) * page_group)
  std::vector<uint32_t> aux;    // per decode aux buffer
  int64_t aux_row = -1;         // decode's metadata slot the sender wrote (-1: none)
  std::vector<uint32_t> state;  // per decode state buffer
  // Per decode state family: the positions [first, first + count) of decode's index list of the
  // family that the digest covers (what the sender wrote; 0, 0 when it wrote none).
  std::vector<std::pair<uint32_t, uint32_t>> state_spans;

  // An all-zero digest of decode's shape.
  static KvDigest Empty(size_t kv_buffers, uint64_t request_pages, size_t aux_buffers,
                        size_t state_buffers, size_t state_families);
  // XOR of `other` into this one; InvalidArgument naming both shapes when they differ, or when
  // both cover state spans that differ.
  Status Merge(const KvDigest& other);
  bool SameShape(const KvDigest& other) const;
};

// Raw CRCs of ranges of one side's memory (spi::DigestRange): crcs[i] for ranges[i].
using RangeCrcFn =
    std::function<Status(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs)>;
// The host's CPU (lib/base/crc32c.h); the zeros after a range are skipped by shift tables cached
// per thread.
Status HostRangeCrcs(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs);

// Where one side's buffers are, in the planner's order (SideLayout kv, aux, state), with their
// item sizes: the source of a sender, or decode's own pools.
struct DigestMemory {
  std::vector<uint64_t> kv, aux, state;                 // base addresses
  std::vector<uint64_t> kv_item, aux_item, state_item;  // item bytes
  // Who reads the KV and state bytes: empty for host memory (HostRangeCrcs); for GPU pools, the
  // transport's DigestRanges (a kernel on the device). Aux buffers are host memory always.
  RangeCrcFn device_crcs;
};

// A decode KV page index -> its position among the request's pages (after the prefix).
class PagePositions {
 public:
  explicit PagePositions(std::span<const int32_t> dst_pages);
  // -1 when `page` is not one of the request's pages.
  int64_t Find(int64_t page) const;

 private:
  std::vector<std::pair<int32_t, uint32_t>> sorted_;  // (page, position), by page
};
// Adds to `digest` what `writes` move: the source bytes at `src` (the planned writes' local
// buffers and offsets), placed as the writes place them in decode's items (`dst_items`: decode's
// item bytes per buffer, kv/aux/state of DigestMemory; the addresses are not used). `positions`
// gives the columns of KV pages; a page it does not hold, or a buffer out of range, is an
// InvalidArgument. Caches its shift tables per thread.
//
// `sent`, when not empty, holds one raw CRC32C per write of the source bytes as the transport
// sent them (Transport::PostWritesDigested), and the source is not read: each write must then
// lie inside one of decode's items (SplitWritesAtItems), else InvalidArgument.
Status AddWritesToDigest(std::span<const planner::PlannedWrite> writes, const DigestMemory& src,
                         const DigestMemory& dst_items, const PagePositions& positions,
                         KvDigest* digest, std::span<const uint32_t> sent = {});
// `writes` cut where they cross one of decode's items (`dst_items`' item bytes per buffer), so
// that each write lands in one item: what AddWritesToDigest needs with send digests. Appends to
// `out`; a buffer out of range, or an item of 0 bytes, is an InvalidArgument.
Status SplitWritesAtItems(std::span<const planner::PlannedWrite> writes,
                          const DigestMemory& dst_items, std::vector<planner::PlannedWrite>* out);

// Which positions of each of decode's state lists the tail `tail` of `plan` writes (decode
// digests those): digest->state_spans, for the families the plan sends state of.
Status FillStateSpans(const planner::PairPlan& plan, const planner::TailInput& tail,
                      KvDigest* digest);

// Decode's pass over what landed: every KV buffer's pages `dst_pages` (the request's pages
// after the prefix, in order), the aux row `aux_index` of every aux buffer (none: no aux), and,
// per state family f, the slots at positions state_spans[f] of its index list (`state_lists`,
// `state_counts` as in TransferInfo; families' buffers in `families`). The result has the shape
// of `expected` (its page_group, its state spans).
struct DigestedFamilies {
  std::span<const planner::StateFamilySpan> families;
  std::span<const int32_t> lists;
  std::span<const uint32_t> counts;
};
// `reader`, when set, computes every range of the pass instead of `mine`'s reader (decode's
// landing digests: what the transport digested as it copied).
StatusOr<KvDigest> DigestLanded(const DigestMemory& mine, std::span<const int32_t> dst_pages,
                                std::optional<uint32_t> aux_index, const DigestedFamilies& state,
                                const KvDigest& expected, const RangeCrcFn& reader = {});

// Every item decode's pass may read for a request, whatever the senders' digests will cover:
// each KV buffer's `dst_pages`, the aux row `aux_index` of each aux buffer, and every listed
// state slot of each family's buffers (spi::DigestRange, zeros_after 0): the cells decode asks
// a transport to digest as it copies (Transport::WatchLandings).
std::vector<spi::DigestRange> LandingCells(const DigestMemory& mine,
                                           std::span<const int32_t> dst_pages,
                                           std::optional<uint32_t> aux_index,
                                           const DigestedFamilies& state);

// What differs between `expected` (what the senders moved) and `landed`, for the message of a
// DATA_LOSS: the KV buffers (named by `kv_name`, e.g. "layer 3 V"), the request page ranges,
// the aux and state buffers. `bad_positions` gets the request page positions of every column
// that differs.
std::string DescribeDigestMismatch(const KvDigest& expected, const KvDigest& landed,
                                   uint64_t request_pages,
                                   const std::function<std::string(uint32_t)>& kv_name,
                                   std::vector<uint64_t>* bad_positions);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_KV_DIGEST_H_
