// The pure half of a prefill host's TP/PP split (examples/hosts/sharding.h): the head-shard copy
// compared byte for byte with KVOffsetInPage, every layout, dtype and TP size; the stage layout
// of each PP stage; the pages a chunk writes.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "examples/hosts/sharding.h"
#include "pdlib_kernels/kv_cache.h"

namespace pdlib::hosts {
namespace {

kernels::ModelConfig PageConfig(KVLayout layout, kernels::KVDtype dtype, int32_t heads) {
  kernels::ModelConfig c;
  c.num_kv_heads = heads;
  c.num_heads = heads;
  c.head_dim = 8;
  c.page_size = 4;
  c.kv_layout = layout;
  c.kv_dtype = dtype;
  return c;
}

TEST_CASE("hosts sharding: CopyHeadShard moves exactly each head slice (KVOffsetInPage)") {
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (kernels::KVDtype dtype : {kernels::KVDtype::kFloat32, kernels::KVDtype::kBFloat16}) {
      const kernels::ModelConfig c = PageConfig(layout, dtype, 4);
      std::vector<std::byte> full(c.kv_page_bytes());
      for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<std::byte>(i * 7 + 3);
      for (int32_t tp : {1, 2, 4}) {
        const int32_t heads = c.num_kv_heads / tp;
        kernels::ModelConfig shard_config = c;
        shard_config.num_kv_heads = heads;
        for (int32_t rank = 0; rank < tp; ++rank) {
          INFO("layout " << KVLayoutName(layout) << ", " << KVDtypeName(dtype) << ", tp " << tp
                         << " rank " << rank);
          std::vector<std::byte> shard(ShardPageBytes(c, heads), std::byte{0xee});
          REQUIRE(shard.size() * static_cast<size_t>(tp) == full.size());
          CopyHeadShard(c, rank * heads, heads, full, shard);
          const size_t elem = c.kv_elem_bytes();
          size_t checked = 0;
          for (int32_t t = 0; t < c.page_size; ++t) {
            for (int32_t h = 0; h < heads; ++h) {
              for (int32_t d = 0; d < c.head_dim; ++d) {
                const size_t from = kernels::KVOffsetInPage(c, t, rank * heads + h, d) * elem;
                const size_t to = kernels::KVOffsetInPage(shard_config, t, h, d) * elem;
                REQUIRE(std::memcmp(shard.data() + to, full.data() + from, elem) == 0);
                checked += elem;
              }
            }
          }
          CHECK(checked == shard.size());  // every shard byte is some head element
        }
      }
    }
  }
}

TEST_CASE("hosts sharding: PP stages own contiguous layers and their KV and state pools") {
  const kernels::ModelConfig small = kernels::ModelConfig::Small();
  auto s0 = MakeStageLayout(small, 1, 0, 2, 0);
  auto s1 = MakeStageLayout(small, 1, 0, 2, 1);
  REQUIRE(s0.ok());
  REQUIRE(s1.ok());
  CHECK((s0->first_layer == 0 && s0->end_layer == 2 && s0->kv_start == 0 && s0->kv_count == 2));
  CHECK((s1->first_layer == 2 && s1->end_layer == 4 && s1->kv_start == 2 && s1->kv_count == 2));
  CHECK((s0->state_count == 0 && s1->state_count == 0));
  CHECK((s0->head_start == 0 && s0->head_count == 2));

  // SmallHybrid: layers 0 A, 1 R, 2 A, 3 R.
  const kernels::ModelConfig hybrid = kernels::ModelConfig::SmallHybrid();
  auto h0 = MakeStageLayout(hybrid, 2, 1, 2, 0);
  auto h1 = MakeStageLayout(hybrid, 2, 1, 2, 1);
  REQUIRE(h0.ok());
  REQUIRE(h1.ok());
  CHECK((h0->kv_start == 0 && h0->kv_count == 1 && h0->state_start == 0 && h0->state_count == 1));
  CHECK((h1->kv_start == 1 && h1->kv_count == 1 && h1->state_start == 1 && h1->state_count == 1));
  CHECK((h1->head_start == 1 && h1->head_count == 1));
  auto whole = MakeStageLayout(hybrid, 1, 0, 1, 0);
  REQUIRE(whole.ok());
  CHECK((whole->kv_count == 2 && whole->state_count == 2));

  // Refused with the numbers.
  auto tp3 = MakeStageLayout(small, 3, 0, 1, 0);
  CHECK(tp3.status().code() == StatusCode::kInvalidArgument);
  CHECK(std::string(tp3.status().message()).find("does not divide the 2 KV heads") !=
        std::string::npos);
  CHECK(MakeStageLayout(small, 1, 0, 5, 0).status().code() == StatusCode::kInvalidArgument);
  // PP 4 on the hybrid model: stage 1 would own only recurrent layer 1.
  auto no_kv = MakeStageLayout(hybrid, 1, 0, 4, 1);
  CHECK(no_kv.status().code() == StatusCode::kInvalidArgument);
  CHECK(std::string(no_kv.status().message()).find("none of them is an attention layer") !=
        std::string::npos);
}

TEST_CASE("hosts sharding: PagesWritten covers the chunk's positions") {
  CHECK((PagesWritten(0, 1, 16).first == 0 && PagesWritten(0, 1, 16).last == 0));
  CHECK((PagesWritten(0, 16, 16).first == 0 && PagesWritten(0, 16, 16).last == 0));
  CHECK((PagesWritten(15, 2, 16).first == 0 && PagesWritten(15, 2, 16).last == 1));
  CHECK((PagesWritten(16, 40, 16).first == 1 && PagesWritten(16, 40, 16).last == 3));
}

}  // namespace
}  // namespace pdlib::hosts
