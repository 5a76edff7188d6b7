// The sharded model (parallel.h): every TP x PP layout gives exactly the results of the whole
// model on one rank, each rank's KV cache holds exactly its heads and layers of the whole
// model's pages, bad layouts are refused with the numbers, and an aborted group unblocks.
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernel_test_util.h"
#include "pdlib_kernels/parallel.h"

namespace pdlib::kernels {
namespace {

using testing::ChunkOf;
using testing::FullOptions;
using testing::PromptTokens;
using testing::Request;
using testing::RequireSame;

// A fixed script of forward passes: two requests prefilled in chunks (one chunk ends inside a
// page, so the next one writes into a half-filled page), then decode steps of one token each.
// Tokens are fixed in advance (teacher forcing), so every layout runs the same batches.
struct Script {
  std::vector<Request> requests;
  std::vector<std::vector<std::pair<int32_t, std::pair<int32_t, int32_t>>>> steps;  // req, range
};

Script MakeScript(const ModelConfig& config) {
  Script s;
  s.requests.resize(2);
  int32_t next_page = 3;  // not 0: pages need not start at the pool's beginning
  const int32_t lengths[2] = {23, 14};
  for (int32_t i = 0; i < 2; ++i) {
    Request& r = s.requests[static_cast<size_t>(i)];
    r.tokens = PromptTokens(100 + static_cast<uint64_t>(i), lengths[i] + 4, config.vocab_size);
    r.state_slot = i;
    testing::EnsurePages(&r, static_cast<int32_t>(r.tokens.size()), config.page_size, &next_page);
  }
  s.steps.push_back({{0, {0, 10}}, {1, {0, 6}}});
  s.steps.push_back({{0, {10, 23}}, {1, {6, 14}}});
  for (int32_t d = 0; d < 4; ++d) s.steps.push_back({{0, {23 + d, 24 + d}}, {1, {14 + d, 15 + d}}});
  return s;
}

struct RankRun {
  std::vector<std::vector<ForwardResult>> results;  // per step
  std::unique_ptr<Model> model;
  Status status;
};

void RunScript(Model* model, const Script& script, RankRun* out) {
  for (const auto& step : script.steps) {
    std::vector<SequenceChunk> batch;
    for (const auto& [req, range] : step) {
      batch.push_back(
          ChunkOf(script.requests[static_cast<size_t>(req)], range.first, range.second));
    }
    std::vector<ForwardResult> results;
    out->status = model->Forward(batch, FullOptions(), &results);
    if (!out->status.ok()) return;
    out->results.push_back(std::move(results));
  }
}

// Runs the script on tp x pp ranks, one thread each, and returns every rank's run.
std::vector<RankRun> RunSharded(const ModelConfig& config, int32_t tp, int32_t pp,
                                int32_t threads_per_rank) {
  StatusOr<ModelWeights> weights = ModelWeights::Random(config, 7);
  REQUIRE(weights.ok());
  const Script script = MakeScript(config);
  std::vector<std::unique_ptr<ModelComm>> comms = CreateInProcessModelComms(tp, pp);
  REQUIRE(comms.size() == static_cast<size_t>(tp * pp));
  std::vector<RankRun> runs(static_cast<size_t>(tp * pp));
  for (int32_t p = 0; p < pp; ++p) {
    for (int32_t t = 0; t < tp; ++t) {
      RuntimeOptions o = testing::TestOptions();
      o.num_threads = threads_per_rank;
      o.shard = {tp, t, pp, p};
      o.comm = tp * pp > 1 ? comms[static_cast<size_t>(o.shard.index())].get() : nullptr;
      StatusOr<std::unique_ptr<Model>> model = Model::Create(*weights, o);
      INFO(model.status().ToString());
      REQUIRE(model.ok());
      runs[static_cast<size_t>(o.shard.index())].model = std::move(model).value();
    }
  }
  std::vector<std::thread> threads;
  for (RankRun& run : runs) {
    threads.emplace_back([&run, &script] { RunScript(run.model.get(), script, &run); });
  }
  for (std::thread& t : threads) t.join();
  for (const RankRun& run : runs) {
    INFO(run.status.ToString());
    REQUIRE(run.status.ok());
  }
  return runs;
}

// Every rank returned the whole model's results, and its pages hold exactly its heads of the
// whole model's pages for its stage's layers.
void RequireMatchesWhole(const ModelConfig& config, int32_t tp, int32_t pp) {
  std::vector<RankRun> whole = RunSharded(config, 1, 1, 2);
  std::vector<RankRun> split = RunSharded(config, tp, pp, 1);
  const Script script = MakeScript(config);
  const KVCache& full = whole[0].model->kv_cache();
  for (const RankRun& rank : split) {
    const ShardLayout& layout = rank.model->shard_layout();
    INFO("rank " << layout.shard.ToString());
    REQUIRE(rank.results.size() == whole[0].results.size());
    for (size_t step = 0; step < rank.results.size(); ++step) {
      REQUIRE(rank.results[step].size() == whole[0].results[step].size());
      for (size_t i = 0; i < rank.results[step].size(); ++i) {
        RequireSame(rank.results[step][i], whole[0].results[step][i]);
      }
    }
    const KVCache& mine = rank.model->kv_cache();
    REQUIRE(mine.num_kv_layers() == layout.kv_count);
    REQUIRE(mine.config().num_kv_heads == layout.kv_head_count);
    const size_t elem = config.kv_elem_bytes();
    const size_t head_bytes = static_cast<size_t>(config.head_dim) * elem;
    for (int32_t l = 0; l < layout.kv_count; ++l) {
      for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
        for (const Request& r : script.requests) {
          for (int32_t page : r.pages) {
            const std::vector<std::byte> a =
                testing::ReadPage(full, kind, layout.kv_start + l, page);
            const std::vector<std::byte> b = testing::ReadPage(mine, kind, l, page);
            for (int32_t t = 0; t < config.page_size; ++t) {
              for (int32_t h = 0; h < layout.kv_head_count; ++h) {
                const size_t from = KVOffsetInPage(config, t, layout.kv_head_start + h, 0) * elem;
                const size_t to = KVOffsetInPage(mine.config(), t, h, 0) * elem;
                REQUIRE(std::memcmp(a.data() + from, b.data() + to, head_bytes) == 0);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sharded model: every TP x PP layout gives the whole model's bits") {
  const ModelConfig tiny = testing::TinyConfig();  // 4 query heads, 2 KV heads, 2 layers
  SECTION("TP 2") { RequireMatchesWhole(tiny, 2, 1); }
  SECTION("TP 4: KV heads replicated on two ranks each") { RequireMatchesWhole(tiny, 4, 1); }
  SECTION("PP 2") { RequireMatchesWhole(tiny, 1, 2); }
  SECTION("TP 2 x PP 2") { RequireMatchesWhole(tiny, 2, 2); }
  SECTION("bf16 HND, TP 2") {
    ModelConfig c = tiny;
    c.kv_dtype = KVDtype::kBFloat16;
    c.kv_layout = KVLayout::kHND;
    RequireMatchesWhole(c, 2, 1);
  }
  SECTION("hybrid (attention, recurrent, attention), TP 2 x PP 2") {
    RequireMatchesWhole(testing::TinyHybridConfig(), 2, 2);
  }
}

TEST_CASE("sharded model: a recurrent rank's state equals the whole model's") {
  const ModelConfig c = testing::TinyHybridConfig();
  std::vector<RankRun> whole = RunSharded(c, 1, 1, 1);
  std::vector<RankRun> split = RunSharded(c, 2, 2, 1);
  for (const RankRun& rank : split) {
    const ShardLayout& layout = rank.model->shard_layout();
    REQUIRE(rank.model->kv_cache().num_state_layers() == layout.state_count);
    for (int32_t l = 0; l < layout.state_count; ++l) {
      for (int32_t slot = 0; slot < 2; ++slot) {
        std::vector<float> a(static_cast<size_t>(c.state_dim())), b(a.size());
        REQUIRE(whole[0].model->kv_cache().ReadState(layout.state_start + l, slot, a).ok());
        REQUIRE(rank.model->kv_cache().ReadState(l, slot, b).ok());
        REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      }
    }
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
  const Script script = MakeScript(tiny);
  RankRun run;
  std::thread rank0([&] { RunScript(model->get(), script, &run); });  // rank 1 never comes
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comms[1]->Abort(Status::Unavailable("rank 1 stopped"));
  rank0.join();
  REQUIRE_FALSE(run.status.ok());
  CHECK_THAT(run.status.ToString(), Catch::Contains("rank 1 stopped"));
  CHECK_THAT(run.status.ToString(), Catch::Contains("TP all-gather"));
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
