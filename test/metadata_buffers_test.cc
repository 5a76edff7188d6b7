#include "pdlib/metadata_buffers.h"

#include <catch2/catch.hpp>
#include <set>
#include <thread>

using pdlib::MetadataBuffers;
using pdlib::MetadataField;
using pdlib::MetadataSlot;
using pdlib::MetadataSlotAllocator;

TEST_CASE("every row is at least 64 bytes and a multiple of 64") {
  auto mb = MetadataBuffers::Create(8, 0, 0);
  REQUIRE(mb.ok());
  for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
    size_t bytes = (*mb)->row_bytes(static_cast<MetadataField>(f));
    CHECK(bytes >= 64);
    CHECK(bytes % 64 == 0);
  }
  CHECK((*mb)->row_bytes(MetadataField::kOutputTopLogprobsVal) == 512);  // 128 x f32
  CHECK((*mb)->row_bytes(MetadataField::kOutputTopkIndex) == 128);       // 16 x i64
  CHECK((*mb)->elements(MetadataField::kBootstrapRoom) == 8);
  auto desc = (*mb)->Describe();
  REQUIRE(desc.size() == pdlib::kMetadataFieldCount);
  for (size_t i = 0; i < desc.size(); ++i) {
    CHECK(desc.lens[i] == desc.item_lens[i] * 8);
    CHECK(desc.ptrs[i] % 64 == 0);
  }
}

TEST_CASE("slot round trip with hidden states") {
  auto created = MetadataBuffers::Create(4, 100, 2);  // 200 bytes -> 256-byte rows
  REQUIRE(created.ok());
  MetadataBuffers& mb = **created;
  CHECK(mb.row_bytes(MetadataField::kOutputHiddenStates) == 256);
  MetadataSlot v;
  for (int i = 0; i < 16; ++i) {
    v.output_ids[i] = 1000 + i;
    v.cached_tokens[i] = i * 3;
    v.output_token_logprobs_val[i] = -0.5f * i;
    v.output_token_logprobs_idx[i] = 7 * i;
    v.output_topk_p[i] = 0.01f * i;
    v.output_topk_index[i] = (int64_t{1} << 40) + i;
  }
  for (int i = 0; i < 128; ++i) {
    v.output_top_logprobs_val[i] = -1.0f * i;
    v.output_top_logprobs_idx[i] = 128 - i;
  }
  v.output_hidden_states.resize(200);
  for (int i = 0; i < 200; ++i) v.output_hidden_states[i] = static_cast<uint8_t>(i * 7);
  v.bootstrap_room[0] = 0x7fffffffffffffffULL;
  REQUIRE(mb.WriteSlot(2, v).ok());

  auto back = mb.ReadSlot(2);
  REQUIRE(back.ok());
  CHECK(*back == v);
  // Typed accessors see the same bytes.
  CHECK(mb.output_ids(2)[5] == 1005);
  CHECK(mb.bootstrap_room(2)[0] == 0x7fffffffffffffffULL);
  CHECK(mb.output_topk_index(2)[3] == (int64_t{1} << 40) + 3);
  CHECK(mb.output_hidden_states(2).size() == 200);
  // Other slots untouched (zeroed).
  auto other = mb.ReadSlot(1);
  REQUIRE(other.ok());
  CHECK(other->output_ids[5] == 0);
  CHECK(other->bootstrap_room[0] == 0);
}

TEST_CASE("slot errors are reported, not written") {
  auto mb = MetadataBuffers::Create(2, 4, 4);
  REQUIRE(mb.ok());
  MetadataSlot v;
  v.output_hidden_states.resize(16);
  CHECK((*mb)->WriteSlot(2, v).code() == pdlib::StatusCode::kOutOfRange);
  CHECK((*mb)->ReadSlot(5).status().code() == pdlib::StatusCode::kOutOfRange);
  v.output_hidden_states.resize(15);
  CHECK((*mb)->WriteSlot(0, v).code() == pdlib::StatusCode::kInvalidArgument);
  CHECK((*mb)->output_ids(2).empty());
  CHECK(MetadataBuffers::Create(0, 0, 0).status().code() == pdlib::StatusCode::kInvalidArgument);
  CHECK(MetadataBuffers::SlotCountFor(48) == 96);
}

TEST_CASE("slot allocator hands out each slot once and refuses double free") {
  MetadataSlotAllocator alloc(3);
  auto a = alloc.Alloc(), b = alloc.Alloc(), c = alloc.Alloc();
  REQUIRE((a && b && c));
  CHECK(std::set<uint32_t>{*a, *b, *c} == std::set<uint32_t>{0, 1, 2});
  CHECK_FALSE(alloc.Alloc().has_value());
  CHECK(alloc.Free(*b).ok());
  CHECK(alloc.Free(*b).code() == pdlib::StatusCode::kFailedPrecondition);
  CHECK(alloc.Free(7).code() == pdlib::StatusCode::kOutOfRange);
  CHECK(alloc.available() == 1);
  CHECK(alloc.Alloc() == b);
}

TEST_CASE("slot allocator is thread-safe") {
  MetadataSlotAllocator alloc(64);
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        auto s = alloc.Alloc();
        if (!s) continue;
        if (!alloc.Free(*s).ok()) errors++;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(errors == 0);
  CHECK(alloc.available() == 64);
}
