// Coalescing and tiling for the cuda_ipc copy engine (issue #19): exact descriptors for the
// shapes that matter, random batches whose bytes must match one memcpy per copy, and the M:N
// re-layout the real planner plans (prefill TP 2 -> decode TP 1, NHD and HND) executed through
// the coalesced descriptors and the kernel's tile decomposition on the CPU, byte for byte.
#include "backends/cuda_ipc/copy_plan.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "lib/planner/kv_layout_testing.h"
#include "lib/planner/planner.h"
#include "test/cuda_ipc/copy_batches.h"

namespace pdlib::cuda_ipc {
namespace {

using testing::Diff;
using testing::RandomBatch;
using testing::RandomBytes;
using testing::Rebase;

std::vector<CopyDesc> Coalesce(const std::vector<ResolvedCopy>& copies) {
  std::vector<CopyDesc> out = {CopyDesc{1, 2, 3, 4, 5, 6}};  // cleared by the call
  CoalesceCopies(copies, &out);
  return out;
}

uint64_t Addr(const std::vector<uint8_t>& v) { return reinterpret_cast<uint64_t>(v.data()); }

TEST_CASE("coalesce: empty and single copies") {
  CHECK(Coalesce({}).empty());
  CHECK(Coalesce({{0x1000, 0x2000, 0}}).empty());  // zero bytes write nothing
  CHECK(Coalesce({{0x1000, 0x2000, 48}}) == std::vector<CopyDesc>{{0x1000, 0x2000, 48, 1, 0, 0}});
}

TEST_CASE("coalesce: pieces contiguous on both sides become one longer piece") {
  // Lengths may differ: whole-page runs of different lengths still join.
  CHECK(Coalesce({{100, 1000, 16}, {116, 1016, 16}, {132, 1032, 32}, {164, 1064, 0}}) ==
        std::vector<CopyDesc>{{100, 1000, 64, 1, 0, 0}});
  // Contiguous on the source only: a strided run, not a longer piece.
  CHECK(Coalesce({{100, 1000, 16}, {116, 1032, 16}}) ==
        std::vector<CopyDesc>{{100, 1000, 16, 2, 16, 32}});
}

TEST_CASE("coalesce: a constant-stride run of equal pieces is one descriptor") {
  // The NHD head slice: 16 token rows of 256 bytes, contiguous on prefill (the rank's whole
  // row), one every 512 bytes on decode (which holds twice the heads).
  std::vector<ResolvedCopy> copies;
  for (uint64_t t = 0; t < 16; ++t) copies.push_back({0x10000 + t * 256, 0x80100 + t * 512, 256});
  CHECK(Coalesce(copies) == std::vector<CopyDesc>{{0x10000, 0x80100, 256, 16, 256, 512}});
  // The next page continues the strides (consecutive pages on both sides): the same descriptor.
  for (uint64_t t = 16; t < 32; ++t) copies.push_back({0x10000 + t * 256, 0x80100 + t * 512, 256});
  CHECK(Coalesce(copies) == std::vector<CopyDesc>{{0x10000, 0x80100, 256, 32, 256, 512}});
  // A source stride of 0 (the same bytes to many places) is a run too.
  CHECK(Coalesce({{8, 0, 8}, {8, 64, 8}, {8, 128, 8}}) ==
        std::vector<CopyDesc>{{8, 0, 8, 3, 0, 64}});
}

TEST_CASE("coalesce: runs break where the stride or the length changes") {
  CHECK(Coalesce({{0, 0, 64}, {128, 256, 64}, {256, 512, 64}, {384, 1024, 64}, {512, 1280, 64}}) ==
        std::vector<CopyDesc>{{0, 0, 64, 3, 128, 256}, {384, 1024, 64, 2, 128, 256}});
  CHECK(Coalesce({{0, 0, 64}, {128, 256, 64}, {256, 512, 32}}) ==
        std::vector<CopyDesc>{{0, 0, 64, 2, 128, 256}, {256, 512, 32, 1, 0, 0}});
  // A new page that does not continue the run starts its own run.
  CHECK(Coalesce({{0, 0, 16}, {16, 32, 16}, {4096, 8192, 16}, {4112, 8224, 16}}) ==
        std::vector<CopyDesc>{{0, 0, 16, 2, 16, 32}, {4096, 8192, 16, 2, 16, 32}});
}

TEST_CASE("coalesce: never backwards, never overlapping on the destination, never wrapping") {
  // Backwards on either side.
  CHECK(Coalesce({{512, 512, 64}, {0, 1024, 64}}).size() == 2);
  CHECK(Coalesce({{0, 1024, 64}, {512, 0, 64}}).size() == 2);
  // Destination stride below the length: the pieces would overlap (order would matter).
  CHECK(Coalesce({{0, 0, 64}, {128, 32, 64}}).size() == 2);
  // Same destination twice.
  CHECK(Coalesce({{0, 0, 64}, {128, 0, 64}}).size() == 2);
  // The end of the address space: src + bytes would wrap; a run's next piece would wrap.
  const uint64_t top = ~uint64_t{0} - 15;
  CHECK(Coalesce({{top, 0, 16}, {0, 16, 16}}).size() == 2);
  const uint64_t high = uint64_t{1} << 63;
  const std::vector<CopyDesc> run = Coalesce({{0, 0, 16}, {high, 32, 16}, {0, 64, 16}});
  CHECK(run == std::vector<CopyDesc>{{0, 0, 16, 2, high, 32}, {0, 64, 16, 1, 0, 0}});
}

TEST_CASE("validate: the limits the kernel relies on") {
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, 0, 16, 4, 16, 16}}).ok());
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, 0, 0, 1, 0, 0}}).code() ==
        StatusCode::kInvalidArgument);
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, 0, 16, 0, 0, 0}}).code() ==
        StatusCode::kInvalidArgument);
  const Status overlap = ValidateDescs(std::vector<CopyDesc>{{0, 0, 16, 1}, {0, 0, 16, 2, 0, 8}});
  CHECK(overlap.code() == StatusCode::kInvalidArgument);
  CHECK(overlap.message().find("copy descriptor 1 of 2") != std::string::npos);
  const uint64_t high = uint64_t{1} << 63;
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, 0, 16, 3, high, 16}}).code() ==
        StatusCode::kInvalidArgument);
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, 0, 16, 2, high, 16}}).ok());
  CHECK(ValidateDescs(std::vector<CopyDesc>{{0, ~uint64_t{0} - 7, 16, 1}}).code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("tiles: vector width, split large pieces, grouped small pieces") {
  TilePlan plan;
  // 10 NHD rows of 256 bytes, 16-aligned: 16 vectors each, 64 rows per 1024-vector tile.
  REQUIRE(PlanTiles(std::vector<CopyDesc>{{0x1000, 0x2000, 256, 10, 256, 512}}, 1024, &plan).ok());
  REQUIRE(plan.descs.size() == 1);
  CHECK(plan.descs[0].unit_shift == 4);
  CHECK(plan.descs[0].units_per_piece == 16);
  CHECK(plan.descs[0].pieces_per_tile == 64);
  CHECK(plan.tile_start == std::vector<uint64_t>{0, 1});
  // 3 HND items of 32 KiB: 2048 vectors, two tiles each. Then an odd address: byte vectors.
  REQUIRE(PlanTiles(std::vector<CopyDesc>{{0, 0x100000, 32768, 3, 32768, 65536},
                                          {0x1001, 0x3000, 40, 1, 0, 0},
                                          {0x1008, 0x4000, 40, 2, 40, 40}},
                    1024, &plan)
              .ok());
  CHECK(plan.descs[0].tiles_per_piece == 2);
  CHECK(plan.descs[0].pieces_per_tile == 1);
  CHECK(plan.descs[1].unit_shift == 0);
  CHECK(plan.descs[2].unit_shift == 3);  // 8-aligned addresses, length and strides
  CHECK(plan.tile_start == std::vector<uint64_t>{0, 6, 7, 8});
  // Strides of a single piece do not matter.
  REQUIRE(PlanTiles(std::vector<CopyDesc>{{0x10, 0x20, 32, 1, 3, 5}}, 1024, &plan).ok());
  CHECK(plan.descs[0].unit_shift == 4);
  CHECK(PlanTiles(std::vector<CopyDesc>{{0, 0, 16, 1}}, 1000, &plan).code() ==
        StatusCode::kInvalidArgument);
  CHECK(PlanTiles(std::vector<CopyDesc>{{0, 0, 0, 1}}, 1024, &plan).code() ==
        StatusCode::kInvalidArgument);
  CHECK(plan.descs.empty());
}

TEST_CASE("property: coalesced and tiled execution writes what one memcpy per copy writes") {
  std::mt19937_64 rng(19);
  constexpr uint64_t kSrc = 1 << 20;
  constexpr uint64_t kDst = 1 << 20;
  const std::vector<uint8_t> src = RandomBytes(rng, kSrc);
  for (int round = 0; round < 60; ++round) {
    const bool aligned = round % 2 == 0;
    const std::vector<ResolvedCopy> copies =
        Rebase(RandomBatch(rng, kSrc, kDst, aligned, 1 + round % 20), Addr(src), 0);
    std::vector<uint8_t> want(kDst, 0xEE), coalesced(kDst, 0xEE), tiled(kDst, 0xEE);
    uint64_t bytes = 0;
    for (const ResolvedCopy& c : copies) {
      std::memcpy(want.data() + c.dst, reinterpret_cast<const void*>(c.src), c.bytes);
      bytes += c.bytes;
    }
    std::vector<CopyDesc> descs;
    CoalesceCopies(Rebase(copies, 0, Addr(coalesced)), &descs);
    REQUIRE(ValidateDescs(descs).ok());
    CHECK(descs.size() <= copies.size());
    CHECK(TotalBytes(descs) == bytes);
    ExecuteOnCpu(descs);
    CHECK(Diff(coalesced, want) == "");

    CoalesceCopies(Rebase(copies, 0, Addr(tiled)), &descs);
    for (uint32_t tile_units : {32u, 1024u}) {
      TilePlan plan;
      REQUIRE(PlanTiles(descs, tile_units, &plan).ok());
      std::fill(tiled.begin(), tiled.end(), 0xEE);
      ExecuteTilesOnCpu(plan, tile_units);
      CHECK(Diff(tiled, want) == "");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// M:N re-layout through the real planner.

using planner::SideLayout;

constexpr int32_t kLayers = 3;
constexpr int32_t kHeads = 4;       // model KV heads
constexpr uint32_t kPageSize = 16;  // tokens per page
constexpr uint64_t kHeadBytes = 64;
constexpr int32_t kPoolPages = 24;

SideLayout Layout(int32_t tp_size, int32_t tp_rank, KVLayout layout) {
  return planner::KvOnlySideLayout({kLayers, kHeads, kPageSize, kHeadBytes, kPoolPages}, tp_size,
                                   tp_rank, layout);
}

// Byte offset of (token, head of `heads`) inside one page.
uint64_t InPage(KVLayout layout, uint32_t token, int32_t head, int32_t heads) {
  return layout == KVLayout::kNHD
             ? (uint64_t{token} * static_cast<uint64_t>(heads) + static_cast<uint64_t>(head)) *
                   kHeadBytes
             : (static_cast<uint64_t>(head) * kPageSize + token) * kHeadBytes;
}

struct Relayout {
  uint64_t writes = 0;
  uint64_t descs = 0;
};

// Plans prefill TP 2 -> decode TP 1 for the page lists, moves the bytes of both prefill ranks
// through CoalesceCopies + ExecuteOnCpu (and again through the tiles), and compares every decode
// buffer with the layout computed here from the model's head order.
Relayout RunRelayout(KVLayout layout, const std::vector<int32_t>& src_pages,
                     const std::vector<int32_t>& dst_pages, std::mt19937_64& rng) {
  constexpr int32_t kPrefillTp = 2;
  constexpr int32_t kPerRank = kHeads / kPrefillTp;
  const SideLayout decode = Layout(1, 0, layout);
  std::vector<std::vector<std::vector<uint8_t>>> prefill_mem(kPrefillTp);
  for (auto& rank : prefill_mem) {
    for (int32_t b = 0; b < 2 * kLayers; ++b) {
      rank.push_back(RandomBytes(rng, Layout(kPrefillTp, 0, layout).kv[0].buffer_bytes));
    }
  }
  const uint64_t decode_bytes = decode.kv[0].buffer_bytes;
  const uint64_t src_item = Layout(kPrefillTp, 0, layout).kv[0].item_bytes;
  const uint64_t dst_item = decode.kv[0].item_bytes;

  // Independently: decode head h of token t is prefill rank h / kPerRank's head h % kPerRank.
  std::vector<std::vector<uint8_t>> want(2 * kLayers, std::vector<uint8_t>(decode_bytes, 0xEE));
  for (int32_t b = 0; b < 2 * kLayers; ++b) {
    for (size_t j = 0; j < src_pages.size(); ++j) {
      for (uint32_t t = 0; t < kPageSize; ++t) {
        for (int32_t h = 0; h < kHeads; ++h) {
          const auto& from = prefill_mem[static_cast<size_t>(h / kPerRank)][static_cast<size_t>(b)];
          std::memcpy(
              want[static_cast<size_t>(b)].data() + dst_pages[j] * dst_item +
                  InPage(layout, t, h, kHeads),
              from.data() + src_pages[j] * src_item + InPage(layout, t, h % kPerRank, kPerRank),
              kHeadBytes);
        }
      }
    }
  }

  Relayout stats;
  std::vector<std::vector<uint8_t>> got(2 * kLayers, std::vector<uint8_t>(decode_bytes, 0xEE));
  std::vector<std::vector<uint8_t>> tiled = got;
  for (int32_t r = 0; r < kPrefillTp; ++r) {
    StatusOr<planner::PairPlan> plan = planner::MakePairPlan(Layout(kPrefillTp, r, layout), decode);
    REQUIRE(plan.ok());
    REQUIRE(plan->active);
    planner::PlanOutput out;
    planner::ChunkPages chunk;
    chunk.src_pages = src_pages;
    chunk.dst_pages = dst_pages;
    chunk.is_last = true;
    const Status planned = planner::PlanKvWrites(*plan, chunk, &out);
    REQUIRE(planned.ok());
    for (auto* dst_mem : {&got, &tiled}) {
      std::vector<ResolvedCopy> copies;
      for (const planner::PlannedWrite& w : out.writes) {
        REQUIRE(w.kind == planner::RegionKind::kKv);
        copies.push_back(
            {Addr(prefill_mem[static_cast<size_t>(r)][w.local_buffer]) + w.local_offset,
             Addr((*dst_mem)[w.remote_buffer]) + w.remote_offset, w.length});
      }
      std::vector<CopyDesc> descs;
      CoalesceCopies(copies, &descs);
      if (dst_mem == &got) {
        ExecuteOnCpu(descs);
        stats.writes += copies.size();
        stats.descs += descs.size();
      } else {
        TilePlan tiles;
        REQUIRE(PlanTiles(descs, 1024, &tiles).ok());
        ExecuteTilesOnCpu(tiles, 1024);
      }
    }
  }
  for (int32_t b = 0; b < 2 * kLayers; ++b) {
    INFO("decode buffer " << b);
    CHECK(Diff(got[static_cast<size_t>(b)], want[static_cast<size_t>(b)]) == "");
    CHECK(Diff(tiled[static_cast<size_t>(b)], want[static_cast<size_t>(b)]) == "");
  }
  return stats;
}

std::vector<int32_t> RandomPages(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> pool(kPoolPages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(n);
  return pool;
}

TEST_CASE("re-layout planning on the CPU reference: prefill TP 2 -> decode TP 1, NHD and HND") {
  std::mt19937_64 rng(1902);
  constexpr uint64_t kBuffers = 2 * kLayers;
  constexpr uint64_t kRanks = 2;
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    const char* name = layout == KVLayout::kNHD ? "NHD" : "HND";
    for (int round = 0; round < 4; ++round) {
      INFO(name << " round " << round);
      const size_t pages = 1 + static_cast<size_t>(round) * 5;
      const std::vector<int32_t> src = RandomPages(rng, pages);
      const std::vector<int32_t> dst = RandomPages(rng, pages);
      const Relayout r = RunRelayout(layout, src, dst, rng);
      // The planner's pieces: page_size per page (NHD) or one per page (HND), per buffer.
      const uint64_t per_page = layout == KVLayout::kNHD ? kPageSize : 1;
      CHECK(r.writes == kRanks * kBuffers * pages * per_page);
      // One pass: at most one descriptor per page per buffer.
      CHECK(r.descs <= kRanks * kBuffers * pages);
    }
    // Consecutive pages on both sides: the strides continue, one descriptor per buffer.
    INFO(name << " consecutive pages");
    const Relayout run = RunRelayout(layout, {3, 4, 5, 6, 7}, {10, 11, 12, 13, 14}, rng);
    CHECK(run.descs == kRanks * kBuffers);
  }
}

}  // namespace
}  // namespace pdlib::cuda_ipc
