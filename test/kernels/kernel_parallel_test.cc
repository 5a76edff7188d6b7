// The sharded model (parallel.h): every TP x PP layout gives exactly the results of the whole
// model on one rank, each rank's KV cache holds exactly its heads and layers of the whole
// model's pages, bad layouts are refused with the numbers, and an aborted group unblocks.
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernel_shard_harness.h"
#include "kernel_test_util.h"
#include "pdlib_kernels/parallel.h"
#include "shard_util.h"

namespace pdlib::kernels {
namespace {

using testing::ChunkOf;
using testing::FullOptions;
using testing::RequireShardsMatchWhole;

TEST_CASE("sharded model: every TP x PP layout gives the whole model's bits") {
  const ModelConfig tiny = testing::TinyConfig();  // 4 query heads, 2 KV heads, 2 layers
  SECTION("TP 2") { RequireShardsMatchWhole(tiny, 2, 1); }
  SECTION("TP 4: KV heads replicated on two ranks each") { RequireShardsMatchWhole(tiny, 4, 1); }
  SECTION("PP 2") { RequireShardsMatchWhole(tiny, 1, 2); }
  SECTION("TP 2 x PP 2") { RequireShardsMatchWhole(tiny, 2, 2); }
  SECTION("bf16 HND, TP 2") {
    ModelConfig c = tiny;
    c.kv_dtype = KVDtype::kBFloat16;
    c.kv_layout = KVLayout::kHND;
    RequireShardsMatchWhole(c, 2, 1);
  }
  SECTION("hybrid (attention, recurrent, attention; state replicated), TP 2 x PP 2") {
    RequireShardsMatchWhole(testing::TinyHybridConfig(), 2, 2);
  }
}

TEST_CASE("sharded model: layouts that cannot be split are refused with the numbers") {
  const ModelConfig tiny = testing::TinyConfig();
  auto error = [&](ModelShard shard) {
    StatusOr<ShardLayout> layout = MakeShardLayout(tiny, shard);
    REQUIRE_FALSE(layout.ok());
    return layout.status().ToString();
  };
  CHECK_THAT(error({3, 0, 1, 0}),
             Catch::Contains("TP 3 does not divide the model's 4 query heads"));
  CHECK_THAT(error({2, 2, 1, 0}), Catch::Contains("out of range"));
  CHECK_THAT(error({1, 0, 3, 0}), Catch::Contains("PP 3 exceeds the model's 2 layers"));
  ModelConfig wide = tiny;
  wide.num_heads = 8;
  wide.num_kv_heads = 4;
  wide.hidden_size = 48;
  wide.intermediate_size = 96;
  StatusOr<ShardLayout> eight = MakeShardLayout(wide, {8, 0, 1, 0});
  REQUIRE(eight.ok());  // 8 ranks over 4 KV heads: each head on two ranks
  CHECK(eight->kv_head_count == 1);
  wide.num_kv_heads = 4;
  wide.num_heads = 12;
  wide.hidden_size = 72;
  wide.intermediate_size = 72;
  StatusOr<ShardLayout> six = MakeShardLayout(wide, {6, 0, 1, 0});
  REQUIRE_FALSE(six.ok());
  CHECK_THAT(six.status().ToString(), Catch::Contains("6 and the model's 4 KV heads"));
  ModelConfig hybrid = testing::TinyHybridConfig();  // attention, recurrent, attention
  hybrid.layer_kinds = {LayerKind::kAttention, LayerKind::kRecurrent, LayerKind::kRecurrent,
                        LayerKind::kAttention};
  hybrid.num_layers = 4;
  // PP 4: stage 1 owns only a recurrent layer.
  StatusOr<ShardLayout> stage = MakeShardLayout(hybrid, {1, 0, 4, 1});
  REQUIRE_FALSE(stage.ok());
  CHECK_THAT(stage.status().ToString(), Catch::Contains("none of them is a full attention layer"));

  StatusOr<ModelWeights> weights = ModelWeights::Random(tiny, 1);
  REQUIRE(weights.ok());
  RuntimeOptions o = testing::TestOptions();
  o.shard = {2, 0, 1, 0};
  StatusOr<std::unique_ptr<Model>> model = Model::Create(*weights, o);
  REQUIRE_FALSE(model.ok());
  CHECK_THAT(model.status().ToString(), Catch::Contains("needs RuntimeOptions::comm"));
}

TEST_CASE("sharded model: aborting the group unblocks a rank waiting for its peers") {
  const ModelConfig tiny = testing::TinyConfig();
  StatusOr<ModelWeights> weights = ModelWeights::Random(tiny, 1);
  REQUIRE(weights.ok());
  std::vector<std::unique_ptr<ModelComm>> comms = CreateInProcessModelComms(2, 1);
  RuntimeOptions o = testing::TestOptions();
  o.shard = {2, 0, 1, 0};
  o.comm = comms[0].get();
  StatusOr<std::unique_ptr<Model>> model = Model::Create(*weights, o);
  REQUIRE(model.ok());
  int32_t next_page = 0;
  const testing::Request r = testing::MakeRequest(tiny, 5, 9, &next_page);
  Status status;
  std::thread rank0([&] {  // rank 1 never comes
    std::vector<ForwardResult> results;
    const SequenceChunk chunk = ChunkOf(r, 0, 9);
    status = (*model)->Forward(std::span<const SequenceChunk>(&chunk, 1), FullOptions(), &results);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comms[1]->Abort(Status::Unavailable("rank 1 stopped"));
  rank0.join();
  REQUIRE_FALSE(status.ok());
  CHECK_THAT(status.ToString(), Catch::Contains("rank 1 stopped"));
  CHECK_THAT(status.ToString(), Catch::Contains("TP all-gather"));
}

TEST_CASE("sharded model: results cross PP stages whole, empty fields included") {
  std::vector<ForwardResult> in(2);
  in[0].token = 7;
  in[0].logprob = -0.25f;
  in[0].top_ids = {7, 3};
  in[0].top_logprobs = {-0.25f, -2.0f};
  in[1].token = 1;  // no top, logits or hidden (what a host asks for: top_k only)
  in[1].logits = {1.5f, -1.0f};
  std::vector<std::byte> bytes;
  internal::SerializeResults(in, &bytes);
  std::vector<ForwardResult> out;
  REQUIRE(internal::DeserializeResults(bytes, &out).ok());
  REQUIRE(out.size() == 2);
  for (size_t i = 0; i < 2; ++i) testing::RequireSame(in[i], out[i]);
  // Truncated, or with a byte too many: refused, never read past the end.
  for (size_t cut : {size_t{0}, size_t{5}, bytes.size() - 1}) {
    std::vector<std::byte> bad(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(cut));
    CHECK(internal::DeserializeResults(bad, &out).code() == StatusCode::kInternal);
  }
  bytes.push_back(std::byte{0});
  CHECK(internal::DeserializeResults(bytes, &out).code() == StatusCode::kInternal);
  internal::SerializeResults({}, &bytes);
  REQUIRE(internal::DeserializeResults(bytes, &out).ok());
  CHECK(out.empty());
}

TEST_CASE("in-process model comms: gather order, stage hand-off and broadcast") {
  std::vector<std::unique_ptr<ModelComm>> comms = CreateInProcessModelComms(2, 2);
  REQUIRE(comms.size() == 4);
  std::vector<std::vector<float>> gathered(4);
  std::vector<std::vector<float>> received(4);
  std::vector<std::vector<std::byte>> cast(4);
  std::vector<Status> status(4);
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      const int32_t tp_rank = i % 2, pp_rank = i / 2;
      ModelComm& c = *comms[static_cast<size_t>(i)];
      for (int round = 0; round < 3 && status[i].ok(); ++round) {
        const std::vector<float> mine = {float(i * 10 + round), float(i * 10 + round + 1)};
        gathered[i].assign(4, -1);
        status[i] = c.AllGather(mine, gathered[i]);
        if (!status[i].ok()) return;
        if (pp_rank == 0) {
          status[i] = c.SendToNextStage(mine);
        } else {
          received[i].assign(2, -1);
          status[i] = c.ReceiveFromPreviousStage(received[i]);
        }
        if (!status[i].ok()) return;
        cast[i] = pp_rank == 1 ? std::vector<std::byte>(size_t(round + 1), std::byte(i))
                               : std::vector<std::byte>{};
        status[i] = c.BroadcastFromLastStage(&cast[i]);
        (void)tp_rank;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int32_t i = 0; i < 4; ++i) {
    INFO("member " << i);
    REQUIRE(status[i].ok());
    const int32_t first = (i / 2) * 2;  // the TP group: members first, first + 1
    CHECK(gathered[i] == std::vector<float>{float(first * 10 + 2), float(first * 10 + 3),
                                            float((first + 1) * 10 + 2),
                                            float((first + 1) * 10 + 3)});
    if (i >= 2)
      CHECK(received[i] == std::vector<float>{float((i - 2) * 10 + 2), float((i - 2) * 10 + 3)});
    // The last round's broadcast from the last stage of the same TP column (member i % 2 + 2).
    CHECK(cast[i] == std::vector<std::byte>(3, std::byte(i % 2 + 2)));
  }
}

}  // namespace
}  // namespace pdlib::kernels
