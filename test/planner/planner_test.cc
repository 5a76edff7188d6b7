// The planner's validation, chunk rules (SPEC R5.2), coalescing (R5.3), DP (R5.7) and a seeded
// property run over random inputs (the fuzzer's decoder, fuzz_case.h).
#include "lib/planner/planner.h"

#include <catch2/catch.hpp>
#include <random>
#include <string>

#include "test/planner/fuzz_case.h"
#include "test/planner/grid.h"
#include "test/planner/reference_model.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {
namespace {

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string_view::npos;
}

// Two layers, 4 heads of 2 bytes, 4-token pages (32-byte pages), 6 pages per buffer, TP 1:1.
PairPlan OneToOne() {
  ModelConfig c = KvConfig(1, 1, 4, 4, KVLayout::kNHD);
  c.head_bytes = 2;
  auto plan = MakePairPlan(MakeLayout(c, true, 0, 0), MakeLayout(c, false, 0, 0));
  REQUIRE(plan.ok());
  return *plan;
}

TEST_CASE("planner coalesces runs contiguous on both sides, for every layer in one batch") {
  const PairPlan plan = OneToOne();
  const std::vector<int32_t> src = {1, 2, 3, 0, 5}, dst = {2, 3, 4, 0, 1};
  ChunkInput in;
  in.pages = {src, dst, false, 20};
  PlanOutput out;
  REQUIRE(PlanChunkWrites(plan, in, &out).ok());
  // Runs: (1..3 -> 2..4), (0 -> 0), (5 -> 1); 4 buffers (2 layers x K, V).
  REQUIRE(out.writes.size() == 3 * 4);
  CHECK(out.writes[0] == PlannedWrite{RegionKind::kKv, 0, 32, 0, 64, 96});
  CHECK(out.writes[1] == PlannedWrite{RegionKind::kKv, 0, 0, 0, 0, 32});
  CHECK(out.writes[2] == PlannedWrite{RegionKind::kKv, 0, 160, 0, 32, 32});
  CHECK(out.writes[3].local_buffer == 2);  // layer 0 V comes right after layer 0 K
  CHECK(out.bytes == 5 * 32 * 4);
}

TEST_CASE("planner chunk rules: whole pages before the last chunk, counts match (R5.2)") {
  const PairPlan plan = OneToOne();
  const std::vector<int32_t> two = {0, 1}, three = {2, 3, 4};
  PlanOutput out;
  ChunkInput in;
  in.pages = {two, two, false, 6};  // 6 tokens = 1.5 pages
  Status s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(s, "not whole 4-token pages"));
  in.pages = {two, two, true, 6};  // the last chunk may end in a partial page, sent whole
  REQUIRE(PlanChunkWrites(plan, in, &out).ok());
  CHECK(out.bytes == 2 * 32 * 4);
  in.pages = {two, two, true, 9};
  CHECK(PlanChunkWrites(plan, in, &out).code() == StatusCode::kInvalidArgument);
  in.pages = {two, three, false, -1};
  s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(out.writes.empty());
  in.pages = {{}, {}, false, 0};  // an empty chunk plans nothing
  REQUIRE(PlanChunkWrites(plan, in, &out).ok());
  CHECK(out.writes.empty());
}

TEST_CASE("planner refuses indices that leave a buffer, naming index, buffer and side") {
  const PairPlan plan = OneToOne();
  PlanOutput out;
  const std::vector<int32_t> ok = {0, 1}, high = {0, 6}, negative = {-3};
  ChunkInput in;
  in.pages = {ok, high, false, -1};
  Status s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message() ==
        "decode kv page index 6 (position 1) out of range [0, 6) of kv buffer 0 on decode tp 0 "
        "pp 0");
  in.pages = {negative, {ok.data(), 1}, false, -1};
  s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(Contains(s, "prefill kv page index -3 (position 0)"));

  const std::vector<int32_t> repeated = {4, 2, 4};
  const std::vector<int32_t> three = {0, 1, 2};
  in.pages = {three, repeated, false, -1};
  s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(s, "decode kv page index 4 appears more than once"));

  // Aux: both slots or neither, each inside its buffers.
  in.pages = {ok, ok, true, -1};
  in.tail.src_aux = 1;
  in.tail.dst_aux = -1;
  CHECK(PlanChunkWrites(plan, in, &out).code() == StatusCode::kInvalidArgument);
  in.tail.dst_aux = 3;
  s = PlanChunkWrites(plan, in, &out);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(Contains(s, "decode aux index 3 (position 0) out of range [0, 3) of aux buffer 0"));
  in.tail.dst_aux = 2;
  REQUIRE(PlanChunkWrites(plan, in, &out).ok());
  REQUIRE(out.writes.size() == 4 + 2);  // KV run per buffer, then one row per aux buffer
  CHECK(out.writes[4] == PlannedWrite{RegionKind::kAux, 0, 8, 0, 16, 8});
  CHECK(out.writes[5] == PlannedWrite{RegionKind::kAux, 1, 4, 1, 8, 4});

  std::vector<int32_t> scratch;
  CHECK(CheckDistinct(repeated, "kv page", "decode", &scratch).code() ==
        StatusCode::kInvalidArgument);
  CHECK(CheckDistinct(three, "kv page", "decode", &scratch).ok());
}

TEST_CASE("planner refuses sides and pairs that cannot exchange KV, saying why") {
  ModelConfig c = KvConfig(2, 1, 4, 4, KVLayout::kNHD);
  SideLayout p = MakeLayout(c, true, 0, 0);
  SideLayout d = MakeLayout(c, false, 0, 0);
  REQUIRE(MakePairPlan(p, d).ok());

  SideLayout bad = p;
  bad.kv_heads = 4;
  Status s = ValidateSideLayout(bad, "prefill");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() == "prefill: holds 4 kv heads, but 4 heads over TP 2 give 2 per rank");
  bad = p;
  bad.kv.pop_back();
  CHECK(Contains(ValidateSideLayout(bad, "prefill"), "a K and a V buffer per layer"));
  bad = p;
  bad.kv[1].item_bytes = 30;
  bad.kv[1].buffer_bytes = 300;
  CHECK(Contains(ValidateSideLayout(bad, "prefill"), "kv buffer 1: 30-byte pages"));
  bad = p;
  bad.tp_rank = 2;
  CHECK(ValidateSideLayout(bad, "prefill").code() == StatusCode::kInvalidArgument);
  bad = p;
  bad.kv[0].buffer_bytes = 1;
  CHECK(Contains(ValidateSideLayout(bad, "prefill"), "item size"));

  SideLayout other = d;
  other.page_size = 8;
  for (auto& b : other.kv) b.item_bytes *= 2, b.buffer_bytes *= 2;
  s = MakePairPlan(p, other).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message() == "page size mismatch: prefill 4 tokens, decode 8");
  other = d;
  for (auto& b : other.kv) b.item_bytes *= 2, b.buffer_bytes *= 2;  // twice the head size
  s = MakePairPlan(p, other).status();
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(s, "head size mismatch"));
  other = d;
  other.layout = KVLayout::kHND;
  CHECK(MakePairPlan(p, other).status().code() == StatusCode::kFailedPrecondition);
  other = d;
  other.aux[1].item_bytes = 8;
  CHECK(Contains(MakePairPlan(p, other).status(), "aux buffer 1 item size mismatch"));
  ModelConfig mla = c;
  mla.mla = true;
  CHECK(Contains(MakePairPlan(p, MakeLayout(mla, false, 0, 0)).status(), "MLA mismatch"));
}

TEST_CASE("planner fills a side from KVArgs") {
  KVArgs args;
  args.kv.lens = {640, 640};
  args.kv.item_lens = {64, 64};
  args.aux.lens = {64};
  args.aux.item_lens = {16};
  args.state.lens = {80, 40};
  args.state.item_lens = {8, 4};
  args.state_type = StateType::kMamba;
  args.state_dim_per_tensor = {0, -1};
  args.page_size = 8;
  args.kv_head_num = 2;
  args.parallel.tp_size = 2;
  args.parallel.tp_rank = 1;
  args.fingerprint.num_layers = 1;
  args.fingerprint.num_kv_heads = 4;
  auto side = SideLayoutFromKVArgs(args);
  REQUIRE(side.ok());
  CHECK(side->num_layers() == 1);
  CHECK(side->state[0].split_dim == 0);
  CHECK(side->state[1].split_dim == -1);
  CHECK(ValidateSideLayout(*side, "prefill").ok());
  args.state_dim_per_tensor = {0};
  CHECK(SideLayoutFromKVArgs(args).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("planner DP group is room % prefill DP size (R5.7)") {
  CHECK(*PrefillDpGroup(10, 4) == 2);
  CHECK(*PrefillDpGroup(uint64_t{1} << 62, 3) == static_cast<int32_t>((uint64_t{1} << 62) % 3));
  CHECK(PrefillDpGroup(1, 0).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("planner property: random inputs never plan a write outside its region") {
  // The fuzzer's decoder on seeded random bytes: structured valid, structured wild and raw.
  std::mt19937_64 rng(20240611);
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> bytes(static_cast<size_t>(16 + rng() % 240));
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const std::string why = RunFuzzCase(bytes.data(), bytes.size());
    if (!why.empty()) {
      INFO("case " << i << ": " << why);
      REQUIRE(why.empty());
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib
