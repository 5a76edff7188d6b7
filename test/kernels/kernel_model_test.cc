// The CPU model's invariants, bit for bit: prefill-then-decode equals recomputation, chunked
// prefill equals one-shot prefill, batching and thread count change nothing, NHD equals HND,
// and KV moved page by page to another model (what pdlib does) decodes like the original.
#include <algorithm>
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
using testing::TinyConfig;
using testing::TinyHybridConfig;

// Prefills `prompt` in chunks of `chunk` tokens, then decodes `steps` tokens greedily. Returns
// the result after the prompt and after each decode step.
std::vector<ForwardResult> Generate(Model& model, Request* r, int32_t chunk, int32_t steps,
                                    int32_t* next_page) {
  const int32_t page_size = model.config().page_size;
  std::vector<ForwardResult> out;
  const int32_t prompt_len = static_cast<int32_t>(r->tokens.size());
  EnsurePages(r, prompt_len, page_size, next_page);
  ForwardResult res;
  for (int32_t begin = 0; begin < prompt_len; begin += chunk) {
    const int32_t end = std::min(prompt_len, begin + chunk);
    Status s = model.Prefill(ChunkOf(*r, begin, end), FullOptions(), &res);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  out.push_back(res);
  for (int32_t i = 0; i < steps; ++i) {
    r->tokens.push_back(res.token);
    const int32_t len = static_cast<int32_t>(r->tokens.size());
    EnsurePages(r, len, page_size, next_page);
    std::vector<ForwardResult> step;
    SequenceChunk c = ChunkOf(*r, len - 1, len);
    REQUIRE(model.Decode(std::span<const SequenceChunk>(&c, 1), FullOptions(), &step).ok());
    res = step[0];
    out.push_back(res);
  }
  return out;
}

TEST_CASE("prefill then decode equals full recomputation, for every layout and dtype") {
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
      ModelConfig c = TinyConfig();
      c.kv_layout = layout;
      c.kv_dtype = dtype;
      auto model = MakeModel(c);
      int32_t next_page = 0;
      Request r{PromptTokens(1, 9, c.vocab_size)};
      const std::vector<ForwardResult> steps = Generate(*model, &r, 9, 6, &next_page);
      // steps[i] follows the first 9 + i tokens; recompute each with one fresh prefill.
      for (size_t i = 0; i < steps.size(); ++i) {
        Request again{std::vector<int32_t>(r.tokens.begin(), r.tokens.begin() + 9 + i)};
        int32_t pages = 32;  // fresh pages, away from the first request's
        auto redo = Generate(*model, &again, 100, 0, &pages);
        RequireSame(steps[i], redo[0]);
      }
    }
  }
}

TEST_CASE("chunked prefill equals one-shot prefill, KV bytes included") {
  ModelConfig c = TinyConfig();
  auto one_shot = MakeModel(c);
  auto chunked = MakeModel(c);
  for (int32_t chunk : {1, 3, 4, 5}) {
    Request a{PromptTokens(2, 13, c.vocab_size)}, b = a;
    int32_t pa = 0, pb = 0;
    auto ra = Generate(*one_shot, &a, 13, 2, &pa);
    auto rb = Generate(*chunked, &b, chunk, 2, &pb);
    REQUIRE(a.tokens == b.tokens);
    for (size_t i = 0; i < ra.size(); ++i) RequireSame(ra[i], rb[i]);
    for (int32_t layer = 0; layer < c.num_layers; ++layer) {
      for (int32_t p = 0; p < pa; ++p) {
        REQUIRE(ReadPage(one_shot->kv_cache(), KVKind::kKey, layer, p) ==
                ReadPage(chunked->kv_cache(), KVKind::kKey, layer, p));
        REQUIRE(ReadPage(one_shot->kv_cache(), KVKind::kValue, layer, p) ==
                ReadPage(chunked->kv_cache(), KVKind::kValue, layer, p));
      }
    }
  }
}

TEST_CASE("batched prefill and decode equal one request at a time") {
  ModelConfig c = TinyConfig();
  auto batched = MakeModel(c);
  auto single = MakeModel(c);
  const std::vector<int32_t> lengths = {3, 7, 12, 1};
  std::vector<Request> reqs;
  int32_t next_page = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    reqs.push_back(Request{PromptTokens(10 + i, lengths[i], c.vocab_size)});
    EnsurePages(&reqs.back(), lengths[i] + 8, c.page_size, &next_page);  // room for decoding
  }
  // One Forward with every prompt vs one Forward per prompt.
  std::vector<SequenceChunk> chunks;
  for (const Request& r : reqs)
    chunks.push_back(ChunkOf(r, 0, static_cast<int32_t>(r.tokens.size())));
  std::vector<ForwardResult> together;
  REQUIRE(batched->Forward(chunks, FullOptions(), &together).ok());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ForwardResult alone;
    REQUIRE(single->Prefill(chunks[i], FullOptions(), &alone).ok());
    RequireSame(together[i], alone);
    reqs[i].tokens.push_back(alone.token);
  }
  // Decode steps: all four at once vs each on its own, with the batch order reversed.
  for (int step = 0; step < 5; ++step) {
    std::vector<SequenceChunk> batch;
    for (size_t i = reqs.size(); i-- > 0;) {
      const int32_t len = static_cast<int32_t>(reqs[i].tokens.size());
      batch.push_back(ChunkOf(reqs[i], len - 1, len));
    }
    std::vector<ForwardResult> out;
    REQUIRE(batched->Decode(batch, FullOptions(), &out).ok());
    for (size_t b = 0; b < batch.size(); ++b) {
      std::vector<ForwardResult> alone;
      REQUIRE(
          single->Decode(std::span<const SequenceChunk>(&batch[b], 1), FullOptions(), &alone).ok());
      RequireSame(out[b], alone[0]);
    }
    for (size_t b = 0; b < batch.size(); ++b)
      reqs[reqs.size() - 1 - b].tokens.push_back(out[b].token);
  }
}

TEST_CASE("results do not depend on the number of threads") {
  ModelConfig c = TinyConfig();
  c.hidden_size = 256;  // big enough that the thread pool really splits the work
  c.intermediate_size = 512;
  RuntimeOptions one = testing::TestOptions(), three = testing::TestOptions();
  one.num_threads = 1;
  three.num_threads = 3;
  auto m1 = MakeModel(c, 7, one);
  auto m3 = MakeModel(c, 7, three);
  // 64 tokens: enough work that attention is split across threads too.
  Request a{PromptTokens(3, 64, c.vocab_size)}, b = a;
  int32_t pa = 0, pb = 0;
  auto ra = Generate(*m1, &a, 64, 3, &pa);
  auto rb = Generate(*m3, &b, 64, 3, &pb);
  for (size_t i = 0; i < ra.size(); ++i) RequireSame(ra[i], rb[i]);
}

TEST_CASE("NHD and HND layouts give the same outputs and the same KV values") {
  ModelConfig nhd = TinyConfig(), hnd = TinyConfig();
  nhd.kv_layout = KVLayout::kNHD;
  hnd.kv_layout = KVLayout::kHND;
  auto mn = MakeModel(nhd);
  auto mh = MakeModel(hnd);
  Request a{PromptTokens(4, 11, nhd.vocab_size)}, b = a;
  int32_t pa = 0, pb = 0;
  auto ra = Generate(*mn, &a, 5, 4, &pa);
  auto rb = Generate(*mh, &b, 5, 4, &pb);
  for (size_t i = 0; i < ra.size(); ++i) RequireSame(ra[i], rb[i]);
  // Same element, different place in the page.
  for (int32_t layer = 0; layer < nhd.num_layers; ++layer) {
    for (int32_t p = 0; p < pa; ++p) {
      auto n_bytes = ReadPage(mn->kv_cache(), KVKind::kValue, layer, p);
      auto h_bytes = ReadPage(mh->kv_cache(), KVKind::kValue, layer, p);
      for (int32_t t = 0; t < nhd.page_size; ++t) {
        for (int32_t h = 0; h < nhd.num_kv_heads; ++h) {
          for (int32_t d = 0; d < nhd.head_dim; ++d) {
            REQUIRE(std::memcmp(&n_bytes[4 * KVOffsetInPage(nhd, t, h, d)],
                                &h_bytes[4 * KVOffsetInPage(hnd, t, h, d)], 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("KV copied page by page into another model decodes exactly like the original") {
  // What a disaggregated deployment does: prefill on one model, pdlib writes the pages into
  // different page indices of the decode model, decode continues there.
  ModelConfig c = TinyConfig();
  c.kv_dtype = KVDtype::kBFloat16;
  c.kv_layout = KVLayout::kHND;
  auto prefill = MakeModel(c);
  auto decode = MakeModel(c);
  Request colocated{PromptTokens(5, 10, c.vocab_size)};
  int32_t next = 0;
  auto first = Generate(*prefill, &colocated, 10, 0, &next);
  Request moved = colocated;
  moved.pages = {40, 17, 33};  // decode's own allocation
  for (size_t i = 0; i < colocated.pages.size(); ++i) {
    for (int32_t layer = 0; layer < c.num_layers; ++layer) {
      for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
        auto bytes = ReadPage(prefill->kv_cache(), kind, layer, colocated.pages[i]);
        REQUIRE(decode->kv_cache().WritePage(kind, layer, moved.pages[i], bytes).ok());
      }
    }
  }
  int32_t next_moved = 50;
  moved.tokens.push_back(first[0].token);
  colocated.tokens.push_back(first[0].token);
  for (int step = 0; step < 6; ++step) {
    std::vector<ForwardResult> x, y;
    const int32_t len = static_cast<int32_t>(colocated.tokens.size());
    EnsurePages(&colocated, len, c.page_size, &next);
    EnsurePages(&moved, len, c.page_size, &next_moved);
    SequenceChunk cx = ChunkOf(colocated, len - 1, len), cy = ChunkOf(moved, len - 1, len);
    REQUIRE(prefill->Decode(std::span<const SequenceChunk>(&cx, 1), FullOptions(), &x).ok());
    REQUIRE(decode->Decode(std::span<const SequenceChunk>(&cy, 1), FullOptions(), &y).ok());
    RequireSame(x[0], y[0]);
    colocated.tokens.push_back(x[0].token);
    moved.tokens.push_back(y[0].token);
  }
}

TEST_CASE("DescribeKV lists every K pool then every V pool with page-sized items") {
  ModelConfig c = TinyConfig();
  RuntimeOptions o = testing::TestOptions();
  o.num_pages = 10;
  auto model = MakeModel(c, 7, o);
  const KVCache& cache = model->kv_cache();
  const BufferFamily kv = cache.DescribeKV();
  REQUIRE(kv.size() == 2 * static_cast<size_t>(c.num_layers));
  CHECK(cache.memory_kind() == MemoryKind::kHost);
  CHECK(cache.DescribeState().empty());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
      const size_t i = static_cast<size_t>(l) + (kind == KVKind::kValue ? c.num_layers : 0);
      const PoolRegion r = cache.pool(kind, l);
      CHECK(kv.ptrs[i] == reinterpret_cast<uint64_t>(r.base));
      CHECK(kv.lens[i] == 10 * c.kv_page_bytes());
      CHECK(kv.item_lens[i] == c.kv_page_bytes());
      CHECK(reinterpret_cast<uintptr_t>(r.base) % 4096 == 0);
    }
  }
  const ModelFingerprint fp = c.Fingerprint();
  CHECK(fp.num_layers == c.num_layers);
  CHECK(fp.num_kv_heads == c.num_kv_heads);
  CHECK(fp.head_dim == c.head_dim);
  CHECK(fp.dtype_bytes == 4);
}

TEST_CASE("bad batches are rejected with a reason and write nothing") {
  ModelConfig c = TinyConfig();
  RuntimeOptions o = testing::TestOptions();
  o.num_pages = 8;
  auto model = MakeModel(c, 7, o);
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  std::vector<int32_t> pages = {0, 1};
  std::vector<ForwardResult> out;
  auto forward = [&](std::vector<SequenceChunk> batch, ForwardOptions opts = {}) {
    return model->Forward(batch, opts, &out);
  };
  SequenceChunk good{tokens, 0, pages};
  CHECK(forward({}).code() == StatusCode::kInvalidArgument);
  CHECK(forward({SequenceChunk{{}, 0, pages}}).code() == StatusCode::kInvalidArgument);
  std::vector<int32_t> bad_token = {1, 97};
  CHECK(forward({SequenceChunk{bad_token, 0, pages}}).code() == StatusCode::kInvalidArgument);
  std::vector<int32_t> short_table = {0};
  Status s = forward({SequenceChunk{tokens, 0, short_table}});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("need 2 pages") != std::string_view::npos);
  std::vector<int32_t> far_page = {0, 8};
  s = forward({SequenceChunk{tokens, 0, far_page}});
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message().find("page index 8") != std::string_view::npos);
  CHECK(forward({SequenceChunk{tokens, -1, pages}}).code() == StatusCode::kInvalidArgument);
  std::vector<int32_t> overlapping = {1, 2};
  s = forward({good, SequenceChunk{tokens, 0, overlapping}});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("also writes") != std::string_view::npos);
  ForwardOptions too_many;
  too_many.top_k = 98;
  CHECK(forward({good}, too_many).code() == StatusCode::kInvalidArgument);
  CHECK(model->Decode(std::vector<SequenceChunk>{good}, {}, &out).code() ==
        StatusCode::kInvalidArgument);
  // Nothing above reached the cache.
  const std::vector<std::byte> zeros(c.kv_page_bytes());
  for (int32_t p = 0; p < 8; ++p) REQUIRE(ReadPage(model->kv_cache(), KVKind::kKey, 0, p) == zeros);
  // Page and state copies are bounds-checked too.
  std::vector<std::byte> page(c.kv_page_bytes());
  CHECK(model->kv_cache().ReadPage(KVKind::kKey, 0, 8, page).code() == StatusCode::kOutOfRange);
  CHECK(model->kv_cache().ReadPage(KVKind::kKey, 2, 0, page).code() == StatusCode::kOutOfRange);
  CHECK(
      model->kv_cache().ReadPage(KVKind::kKey, 0, 0, std::span<std::byte>(page.data(), 3)).code() ==
      StatusCode::kInvalidArgument);
  std::vector<float> state(static_cast<size_t>(c.state_dim()));
  CHECK(model->kv_cache().ReadState(0, 0, state).code() == StatusCode::kOutOfRange);
  // And a good batch still works afterwards.
  CHECK(forward({good}).ok());
}

TEST_CASE("Model::Create validates weights and options") {
  StatusOr<ModelWeights> w = ModelWeights::Random(TinyConfig(), 1);
  REQUIRE(w.ok());
  RuntimeOptions o;
  o.num_pages = 0;
  CHECK(Model::Create(*w, o).status().code() == StatusCode::kInvalidArgument);
  ModelWeights broken = *w;
  broken.layers[1].q_proj.pop_back();
  Status s = Model::Create(broken, {}).status();
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("model.layers.1.self_attn.q_proj.weight") != std::string_view::npos);
  ModelConfig c = TinyConfig();
  c.num_kv_heads = 3;
  CHECK(ModelWeights::Random(c, 1).status().code() == StatusCode::kInvalidArgument);
  c = TinyConfig();
  c.layer_kinds = {LayerKind::kAttention};
  CHECK(c.Validate().code() == StatusCode::kInvalidArgument);
  CHECK(ModelConfig::Small().Validate().ok());
  CHECK(ModelConfig::SmallHybrid().Validate().ok());
  CHECK(ModelConfig::SmallHybrid().num_recurrent_layers() == 2);
}

TEST_CASE("the default config generates varied tokens") {
  // A sanity check that the random weights make a usable model: the greedy continuation is not
  // one token repeated, and the chosen token is clearly preferred.
  auto model = MakeModel(ModelConfig::Small());
  Request r{PromptTokens(6, 8, 512)};
  int32_t next = 0;
  auto out = Generate(*model, &r, 8, 8, &next);
  std::vector<int32_t> generated(r.tokens.begin() + 8, r.tokens.end());
  std::sort(generated.begin(), generated.end());
  CHECK(std::unique(generated.begin(), generated.end()) - generated.begin() > 1);
  CHECK(out[0].logprob > -3.0f);
  CHECK(out[0].top_ids[0] == out[0].token);
}

// Layer-wise streaming (ForwardOptions::on_kv_layers_done): one call per KV layer, in order,
// made once that layer's pages hold the chunk's final K/V and before the next KV layer is
// written; recurrent layers are not counted; the results are those of a plain forward.
TEST_CASE("on_kv_layers_done reports each KV layer as soon as its pages are final") {
  for (const ModelConfig& c : {TinyConfig(), TinyHybridConfig()}) {
    INFO("layers " << c.num_layers << ", KV layers " << c.num_attention_layers());
    auto streamed = MakeModel(c);
    auto plain = MakeModel(c);
    Request r{PromptTokens(5, 10, c.vocab_size)};
    int32_t next_page = 0;
    EnsurePages(&r, 10, c.page_size, &next_page);
    const SequenceChunk chunk = ChunkOf(r, 0, 10);
    struct Seen {
      int32_t done;
      std::vector<std::vector<std::byte>> last, next;  // pages of layer done-1 and of layer done
    };
    std::vector<Seen> seen;
    auto pages_of = [&](const Model& m, int32_t layer) {
      std::vector<std::vector<std::byte>> out;
      for (int32_t p : r.pages) {
        out.push_back(ReadPage(m.kv_cache(), KVKind::kKey, layer, p));
        out.push_back(ReadPage(m.kv_cache(), KVKind::kValue, layer, p));
      }
      return out;
    };
    ForwardOptions o = FullOptions();
    o.on_kv_layers_done = [&](int32_t done) {
      Seen s{done, pages_of(*streamed, done - 1), {}};
      if (done < c.num_attention_layers()) s.next = pages_of(*streamed, done);
      seen.push_back(std::move(s));
    };
    ForwardResult a, b;
    REQUIRE(streamed->Prefill(chunk, o, &a).ok());
    REQUIRE(plain->Prefill(chunk, FullOptions(), &b).ok());
    RequireSame(a, b);
    REQUIRE(static_cast<int32_t>(seen.size()) == c.num_attention_layers());
    for (size_t i = 0; i < seen.size(); ++i) {
      CHECK(seen[i].done == static_cast<int32_t>(i) + 1);
      CHECK(seen[i].last == pages_of(*streamed, seen[i].done - 1));  // final when reported
      CHECK(seen[i].last == pages_of(*plain, seen[i].done - 1));
      if (!seen[i].next.empty()) CHECK(seen[i].next != pages_of(*streamed, seen[i].done));
    }
  }
}

}  // namespace
}  // namespace pdlib::kernels
