// What each rank of a host registers with pdlib (examples/hosts/sharding.h, RankKVArgs) for every
// model and split, from the rank's own sharded cache; and the test-only fault's page corruption
// (CorruptReceivedPage) byte for byte against KVOffsetInPage, for every kind of page.
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <vector>

#include "examples/hosts/host_rank.h"
#include "examples/hosts/sharding.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {
namespace {

// One rank's model of `name` split tp x pp, and the KVArgs it registers.
struct RankArgs {
  std::vector<std::unique_ptr<kernels::ModelComm>> comms;
  std::unique_ptr<kernels::Model> model;
  KVArgs args;
};

RankArgs Make(const std::string& name, int32_t tp, int32_t tp_rank, int32_t pp, int32_t pp_rank) {
  RankArgs r;
  auto config = ModelConfigByName(name);
  REQUIRE(config.ok());
  auto weights = kernels::ModelWeights::Random(*config, 3);
  REQUIRE(weights.ok());
  r.comms = kernels::CreateInProcessModelComms(tp, pp);
  kernels::RuntimeOptions rt;
  rt.num_pages = 8;
  rt.num_state_slots = 2;
  rt.num_threads = 1;
  rt.shard = {.tp_size = tp, .tp_rank = tp_rank, .pp_size = pp, .pp_rank = pp_rank};
  rt.comm = r.comms[static_cast<size_t>(rt.shard.index())].get();
  auto model = kernels::Model::Create(*weights, rt);
  INFO(model.status().ToString());
  REQUIRE(model.ok());
  r.model = std::move(*model);
  auto args = RankKVArgs(r.model->config(), r.model->shard_layout(), r.model->kv_cache(), "m");
  INFO(args.status().ToString());
  REQUIRE(args.ok());
  r.args = std::move(*args);
  return r;
}

uint64_t Page(int32_t heads, int32_t width) { return 16ull * heads * width * sizeof(float); }

TEST_CASE("hosts sharding: a GQA rank registers its own heads and layers") {
  // Small: 4 attention layers, 2 KV heads of 64.
  RankArgs tp2 = Make("small", 2, 1, 1, 0);
  CHECK(tp2.args.kv.size() == 8);  // K of 4 layers, then V
  for (uint64_t item : tp2.args.kv.item_lens) CHECK(item == Page(1, 64));
  CHECK((tp2.args.kv_head_num == 1 && !tp2.args.is_mla && tp2.args.prefill_start_layer == 0));
  CHECK((tp2.args.parallel.tp_size == 2 && tp2.args.parallel.tp_rank == 1));
  CHECK(tp2.args.state_type == StateType::kNone);
  CHECK(tp2.args.state.empty());
  CHECK(tp2.args.fingerprint.num_kv_heads == 2);  // the whole model's
  CHECK(tp2.args.fingerprint.num_layers == 4);
  CHECK(tp2.args.kv.ptrs[0] ==
        reinterpret_cast<uint64_t>(tp2.model->kv_cache().pool(kernels::KVKind::kKey, 0).base));

  // TP 4 on 2 KV heads: each rank holds one head, replicated on two ranks.
  RankArgs tp4 = Make("small", 4, 3, 1, 0);
  CHECK(tp4.args.kv_head_num == 1);
  for (uint64_t item : tp4.args.kv.item_lens) CHECK(item == Page(1, 64));

  RankArgs pp2 = Make("small", 1, 0, 2, 1);
  CHECK(pp2.args.kv.size() == 4);  // layers 2 and 3
  CHECK((pp2.args.prefill_start_layer == 2 && pp2.args.kv_head_num == 2));
  CHECK((pp2.args.parallel.pp_size == 2 && pp2.args.parallel.pp_rank == 1));
  for (uint64_t item : pp2.args.kv.item_lens) CHECK(item == Page(2, 64));
}

TEST_CASE("hosts sharding: an MLA rank registers one latent pool per layer") {
  RankArgs r = Make("small-mla", 2, 1, 2, 1);
  CHECK(r.args.is_mla);
  CHECK(r.args.kv_head_num == 1);
  CHECK(r.args.kv.size() == 2);  // layers 2 and 3, no V pools
  for (uint64_t item : r.args.kv.item_lens) CHECK(item == Page(1, 64 + 32));
  CHECK(r.args.prefill_start_layer == 2);
}

TEST_CASE("hosts sharding: recurrent state is replicated, sliding-window pages split by heads") {
  // SmallHybrid: layers 0 A, 1 R, 2 A, 3 R.
  RankArgs h = Make("small-hybrid", 2, 1, 2, 1);
  CHECK(h.args.state_type == StateType::kMamba);
  CHECK((h.args.kv.size() == 2 && h.args.prefill_start_layer == 1));
  CHECK((h.args.state.size() == 1 && h.args.state_start == 1));
  CHECK(h.args.state_dim_per_tensor == std::vector<int32_t>{-1});

  // SmallSwa: layers 0 A, 1 S, 2 A, 3 S; stage 1 of 2 holds A 2 and S 3.
  RankArgs s = Make("small-swa", 2, 0, 2, 1);
  CHECK(s.args.state_type == StateType::kSwa);
  CHECK((s.args.kv.size() == 2 && s.args.prefill_start_layer == 1));
  CHECK(s.args.state.size() == 2);  // K and V of SWA layer 1 (model layer 3)
  CHECK(s.args.state_start == 2);
  for (uint64_t item : s.args.state.item_lens) CHECK(item == Page(1, 64));
  CHECK(s.args.state_dim_per_tensor == std::vector<int32_t>{1, 1});  // NHD: heads after tokens
  CHECK(s.args.state_item_rows == std::vector<uint64_t>{16, 16});
  CHECK(s.args.state_split_units == std::vector<uint64_t>{2, 2});
  CHECK(s.args.state.ptrs[1] ==
        reinterpret_cast<uint64_t>(s.model->kv_cache().swa_pool(kernels::KVKind::kValue, 0).base));
  RankArgs whole = Make("small-swa", 1, 0, 1, 0);
  CHECK((whole.args.state.size() == 4 && whole.args.state_start == 0 && whole.args.kv.size() == 4));
}

TEST_CASE("hosts sharding: an NSA rank registers its index pools, replicated, as kNsa state") {
  // SmallNsa: 4 attention layers, each with an indexer of 32 fp32 keys per token.
  RankArgs r = Make("small-nsa", 2, 1, 2, 1);
  CHECK(r.args.state_type == StateType::kNsa);
  CHECK((r.args.kv.size() == 4 && r.args.prefill_start_layer == 2 && r.args.kv_head_num == 1));
  CHECK((r.args.state.size() == 2 && r.args.state_start == 2));  // layers 2 and 3
  for (uint64_t item : r.args.state.item_lens) CHECK(item == 16ull * 32 * sizeof(float));
  CHECK(r.args.state_dim_per_tensor == std::vector<int32_t>{-1, -1});
  CHECK(r.args.state.ptrs[1] == reinterpret_cast<uint64_t>(r.model->kv_cache().index_pool(1).base));
}

kernels::ModelConfig PageConfig(KVLayout layout, int32_t heads) {
  kernels::ModelConfig c;
  c.num_kv_heads = heads;
  c.num_heads = heads;
  c.head_dim = 8;
  c.page_size = 4;
  c.kv_layout = layout;
  return c;
}

std::vector<std::byte> Filled(size_t n) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(i * 7 + 3);
  return v;
}

TEST_CASE("hosts sharding: the test fault swaps two heads, or keys of neighbouring tokens") {
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    INFO(KVLayoutName(layout));
    const size_t e = sizeof(float);
    {
      const kernels::ModelConfig c = PageConfig(layout, 3);
      for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
        const std::vector<std::byte> before = Filled(c.kv_page_bytes());
        std::vector<std::byte> page = before;
        CorruptReceivedPage(c, kind, page);
        for (int32_t t = 0; t < c.page_size; ++t) {
          for (int32_t h = 0; h < 3; ++h) {
            const int32_t from = h == 0 ? 1 : h == 1 ? 0 : 2;
            for (int32_t d = 0; d < c.head_dim; ++d) {
              REQUIRE(std::memcmp(page.data() + kernels::KVOffsetInPage(c, t, h, d) * e,
                                  before.data() + kernels::KVOffsetInPage(c, t, from, d) * e,
                                  e) == 0);
            }
          }
        }
      }
    }
    {
      const kernels::ModelConfig c = PageConfig(layout, 1);
      const std::vector<std::byte> before = Filled(c.kv_page_bytes());
      std::vector<std::byte> v = before;
      CorruptReceivedPage(c, kernels::KVKind::kValue, v);
      CHECK(v == before);  // values stay with their positions
      std::vector<std::byte> k = before;
      CorruptReceivedPage(c, kernels::KVKind::kKey, k);
      for (int32_t t = 0; t < c.page_size; ++t) {
        for (int32_t d = 0; d < c.head_dim; ++d) {
          REQUIRE(std::memcmp(k.data() + kernels::KVOffsetInPage(c, t, 0, d) * e,
                              before.data() + kernels::KVOffsetInPage(c, t ^ 1, 0, d) * e, e) == 0);
        }
      }
    }
  }
  // MLA: the rotated-key part of neighbouring latent rows swaps, the latent stays.
  const kernels::ModelConfig mla = kernels::ModelConfig::SmallMla();
  const size_t row = static_cast<size_t>(mla.kv_width()) * sizeof(float);
  const size_t rope = static_cast<size_t>(mla.qk_rope_dim) * sizeof(float);
  const std::vector<std::byte> before = Filled(mla.kv_page_bytes());
  std::vector<std::byte> page = before;
  CorruptReceivedPage(mla, kernels::KVKind::kKey, page);
  for (int32_t t = 0; t < mla.page_size; ++t) {
    const size_t at = static_cast<size_t>(t) * row;
    const size_t other = static_cast<size_t>(t ^ 1) * row;
    REQUIRE(std::memcmp(page.data() + at, before.data() + at, row - rope) == 0);
    REQUIRE(std::memcmp(page.data() + at + row - rope, before.data() + other + row - rope, rope) ==
            0);
  }
}

TEST_CASE("hosts sharding: the swap-index fault swaps the index keys of neighbouring tokens") {
  kernels::ModelConfig c = kernels::ModelConfig::SmallNsa();
  c.page_size = 5;  // an odd page: the last token keeps its keys
  const size_t row = static_cast<size_t>(c.index_dim) * sizeof(float);
  const std::vector<std::byte> before = Filled(c.index_page_bytes());
  std::vector<std::byte> after = before;
  CorruptReceivedIndexPage(c, after);
  for (int32_t t = 0; t < c.page_size; ++t) {
    const int32_t from = t == c.page_size - 1 ? t : (t % 2 == 0 ? t + 1 : t - 1);
    CHECK(std::memcmp(after.data() + static_cast<size_t>(t) * row,
                      before.data() + static_cast<size_t>(from) * row, row) == 0);
  }
}

}  // namespace
}  // namespace pdlib::hosts
