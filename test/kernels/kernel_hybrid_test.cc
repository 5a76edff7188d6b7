// Hybrid models: recurrent layers keep a per-request state slot beside the paged KV. The same
// bit-exact invariants as the attention-only model hold, and moving pages plus the state slot
// to another model (pdlib's state_type mamba transfer) continues the request exactly.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "kernel_test_util.h"
#include "pdlib_kernels/model.h"

namespace pdlib::kernels {
namespace {

using testing::ChunkOf;
using testing::EnsurePages;
using testing::FullOptions;
using testing::MakeModel;
using testing::PromptTokens;
using testing::ReadPage;
using testing::Request;
using testing::RequireSame;
using testing::TinyHybridConfig;

ForwardResult Step(Model& model, const Request& r, int32_t begin, int32_t end) {
  ForwardResult out;
  Status s = model.Prefill(ChunkOf(r, begin, end), FullOptions(), &out);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return out;
}

std::vector<float> State(const Model& model, int32_t layer, int32_t slot) {
  std::vector<float> state(static_cast<size_t>(model.config().state_dim()));
  REQUIRE(model.kv_cache().ReadState(layer, slot, state).ok());
  return state;
}

TEST_CASE("hybrid: state pools are described per recurrent layer") {
  ModelConfig c = TinyHybridConfig();
  RuntimeOptions o = testing::TestOptions();
  o.num_state_slots = 5;
  auto model = MakeModel(c, 3, o);
  const KVCache& cache = model->kv_cache();
  CHECK(cache.num_kv_layers() == 2);
  CHECK(cache.num_state_layers() == 1);
  CHECK(c.kv_layer_index(2) == 1);
  CHECK(c.state_layer_index(1) == 0);
  CHECK(c.kv_layer_index(1) == -1);
  const BufferFamily state = cache.DescribeState();
  REQUIRE(state.size() == 1);
  CHECK(state.lens[0] == 5 * c.state_slot_bytes());
  CHECK(state.item_lens[0] == c.hidden_size * sizeof(float));
  CHECK(cache.DescribeKV().size() == 4);
  CHECK(c.Fingerprint().num_layers == 2);
}

TEST_CASE("hybrid: chunked prefill and decode equal one-shot recomputation") {
  ModelConfig c = TinyHybridConfig();
  auto model = MakeModel(c);
  Request r{PromptTokens(21, 10, c.vocab_size)};
  r.state_slot = 2;
  int32_t next = 0;
  EnsurePages(&r, 16, c.page_size, &next);
  // Prefill in chunks of 4, 4, 2, then decode 4 tokens.
  std::vector<ForwardResult> steps;
  Step(*model, r, 0, 4);
  Step(*model, r, 4, 8);
  steps.push_back(Step(*model, r, 8, 10));
  for (int i = 0; i < 4; ++i) {
    r.tokens.push_back(steps.back().token);
    const int32_t len = static_cast<int32_t>(r.tokens.size());
    steps.push_back(Step(*model, r, len - 1, len));
  }
  const std::vector<float> final_state = State(*model, 0, 2);
  // Each prefix again in one shot, in another slot (and other pages).
  for (size_t i = 0; i < steps.size(); ++i) {
    Request again{std::vector<int32_t>(r.tokens.begin(), r.tokens.begin() + 10 + i)};
    again.state_slot = 7;
    int32_t pages = 40;
    EnsurePages(&again, static_cast<int32_t>(again.tokens.size()), c.page_size, &pages);
    RequireSame(steps[i], Step(*model, again, 0, static_cast<int32_t>(again.tokens.size())));
  }
  // The last recomputation covered all 14 tokens: its state matches the incremental one.
  REQUIRE(State(*model, 0, 7) == final_state);
}

TEST_CASE("hybrid: batched decode equals one request at a time") {
  ModelConfig c = TinyHybridConfig();
  auto batched = MakeModel(c);
  auto single = MakeModel(c);
  std::vector<Request> reqs;
  int32_t next = 0;
  for (int i = 0; i < 3; ++i) {
    reqs.push_back(Request{PromptTokens(30 + i, 2 + 3 * i, c.vocab_size)});
    reqs.back().state_slot = 3 - i;
    EnsurePages(&reqs.back(), 20, c.page_size, &next);
    const int32_t len = static_cast<int32_t>(reqs.back().tokens.size());
    ForwardResult a = Step(*batched, reqs.back(), 0, len), b = Step(*single, reqs.back(), 0, len);
    RequireSame(a, b);
    reqs.back().tokens.push_back(a.token);
  }
  for (int step = 0; step < 4; ++step) {
    std::vector<SequenceChunk> batch;
    for (const Request& r : reqs) {
      const int32_t len = static_cast<int32_t>(r.tokens.size());
      batch.push_back(ChunkOf(r, len - 1, len));
    }
    std::vector<ForwardResult> out;
    REQUIRE(batched->Decode(batch, FullOptions(), &out).ok());
    for (size_t i = 0; i < reqs.size(); ++i) {
      const int32_t len = static_cast<int32_t>(reqs[i].tokens.size());
      RequireSame(out[i], Step(*single, reqs[i], len - 1, len));
    }
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].tokens.push_back(out[i].token);
  }
  for (const Request& r : reqs) {
    REQUIRE(State(*batched, 0, r.state_slot) == State(*single, 0, r.state_slot));
  }
}

TEST_CASE("hybrid: moving pages and the state slot continues the request exactly") {
  ModelConfig c = TinyHybridConfig();
  c.kv_dtype = KVDtype::kBFloat16;
  auto prefill = MakeModel(c);
  auto decode = MakeModel(c);
  Request local{PromptTokens(40, 9, c.vocab_size)};
  local.state_slot = 1;
  int32_t next = 0;
  EnsurePages(&local, 9, c.page_size, &next);
  ForwardResult first = Step(*prefill, local, 0, 9);

  Request moved = local;
  moved.state_slot = 4;
  moved.pages = {9, 3, 12};
  for (size_t i = 0; i < local.pages.size(); ++i) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
        auto bytes = ReadPage(prefill->kv_cache(), kind, layer, local.pages[i]);
        REQUIRE(decode->kv_cache().WritePage(kind, layer, moved.pages[i], bytes).ok());
      }
    }
  }
  std::vector<float> state = State(*prefill, 0, local.state_slot);
  REQUIRE(decode->kv_cache().WriteState(0, moved.state_slot, state).ok());

  int32_t next_moved = 20;
  local.tokens.push_back(first.token);
  moved.tokens.push_back(first.token);
  for (int step = 0; step < 5; ++step) {
    const int32_t len = static_cast<int32_t>(local.tokens.size());
    EnsurePages(&local, len, c.page_size, &next);
    EnsurePages(&moved, len, c.page_size, &next_moved);
    ForwardResult a = Step(*prefill, local, len - 1, len);
    ForwardResult b = Step(*decode, moved, len - 1, len);
    RequireSame(a, b);
    local.tokens.push_back(a.token);
    moved.tokens.push_back(b.token);
  }
}

TEST_CASE("hybrid: start_pos 0 starts from a zero state, and slots are validated") {
  ModelConfig c = TinyHybridConfig();
  RuntimeOptions o = testing::TestOptions();
  o.num_state_slots = 4;
  auto model = MakeModel(c, 7, o);
  Request r{PromptTokens(50, 6, c.vocab_size)};
  r.state_slot = 0;
  int32_t next = 0;
  EnsurePages(&r, 6, c.page_size, &next);
  ForwardResult fresh = Step(*model, r, 0, 6);
  // Dirty the slot, then reuse it for the same prompt: a new request ignores what was there.
  std::vector<float> junk(static_cast<size_t>(c.state_dim()), 123.0f);
  REQUIRE(model->kv_cache().WriteState(0, 0, junk).ok());
  RequireSame(fresh, Step(*model, r, 0, 6));

  std::vector<ForwardResult> out;
  SequenceChunk bad = ChunkOf(r, 0, 6);
  bad.state_slot = -1;
  CHECK(model->Forward(std::vector<SequenceChunk>{bad}, {}, &out).code() ==
        StatusCode::kOutOfRange);
  bad.state_slot = 4;
  CHECK(model->Forward(std::vector<SequenceChunk>{bad}, {}, &out).code() ==
        StatusCode::kOutOfRange);
  Request other{PromptTokens(51, 3, c.vocab_size)};
  other.state_slot = 0;  // same slot as r
  EnsurePages(&other, 3, c.page_size, &next);
  Status s =
      model->Forward(std::vector<SequenceChunk>{ChunkOf(r, 0, 6), ChunkOf(other, 0, 3)}, {}, &out);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("state slot 0") != std::string_view::npos);
  RuntimeOptions none;
  none.num_state_slots = 0;
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 1);
  REQUIRE(w.ok());
  CHECK(Model::Create(*w, none).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdlib::kernels
