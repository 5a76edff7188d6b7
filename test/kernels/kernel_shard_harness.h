// Model-level checks the kernel tests share for every model variant: chunked == one-shot and
// batched == alone over every pool a request fills, and the sharded-model check (parallel.h):
// one script of forward passes run on tp x pp ranks (a thread each) and on the whole model, then
// every rank's results and pools compared with the whole model's, bit for bit.
#ifndef PDLIB_TEST_KERNELS_KERNEL_SHARD_HARNESS_H_
#define PDLIB_TEST_KERNELS_KERNEL_SHARD_HARNESS_H_

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "kernel_test_util.h"
#include "pdlib_kernels/parallel.h"

namespace pdlib::kernels::testing {

// A model of `c` with seed-7 weights and `threads` workers.
inline std::unique_ptr<Model> MakeWithThreads(const ModelConfig& c, int32_t threads = 2) {
  RuntimeOptions o = TestOptions();
  o.num_threads = threads;
  return MakeModel(c, 7, o);
}

// One forward pass that must succeed.
inline std::vector<ForwardResult> RunBatch(Model& m, const std::vector<SequenceChunk>& batch) {
  std::vector<ForwardResult> results;
  const Status s = m.Forward(batch, FullOptions(), &results);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return results;
}

// The pages of every pool that holds a request's tokens: KV pools (MLA: the latent pool), SWA
// pools and index pools.
inline std::vector<std::vector<std::byte>> AllPages(const KVCache& cache, const Request& r) {
  std::vector<std::vector<std::byte>> out;
  const ModelConfig& c = cache.config();
  auto read = [&](size_t bytes, auto&& fill) {
    for (int32_t page : r.pages) {
      std::vector<std::byte> b(bytes);
      REQUIRE(fill(page, b).ok());
      out.push_back(std::move(b));
    }
  };
  for (int32_t l = 0; l < cache.num_kv_layers(); ++l) {
    for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
      if (cache.pool(kind, l).base == nullptr) continue;  // MLA has no V pool
      read(c.kv_page_bytes(),
           [&](int32_t p, std::span<std::byte> b) { return cache.ReadPage(kind, l, p, b); });
    }
  }
  for (int32_t l = 0; l < cache.num_swa_layers(); ++l) {
    for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
      read(c.kv_page_bytes(),
           [&](int32_t p, std::span<std::byte> b) { return cache.ReadSwaPage(kind, l, p, b); });
    }
  }
  for (int32_t l = 0; l < cache.num_index_layers(); ++l) {
    read(c.index_page_bytes(),
         [&](int32_t p, std::span<std::byte> b) { return cache.ReadIndexPage(l, p, b); });
  }
  return out;
}

inline Request MakeRequest(const ModelConfig& c, uint64_t seed, int32_t n, int32_t* next_page) {
  Request r;
  r.tokens = PromptTokens(seed, n, c.vocab_size);
  EnsurePages(&r, n, c.page_size, next_page);
  return r;
}

// A 22-token prompt prefilled in chunks of 5, 8 and 8 tokens, then one decode step, gives the
// one-shot prefill's results and pages, bit for bit.
inline void RequireChunkedEqualsOneShot(const ModelConfig& c) {
  INFO(c.ToString());
  int32_t next_page = 1;
  Request r = MakeRequest(c, 11, 22, &next_page);
  auto one_shot = MakeWithThreads(c);
  const std::vector<ForwardResult> whole = RunBatch(*one_shot, {ChunkOf(r, 0, 22)});
  auto chunked = MakeWithThreads(c);
  RunBatch(*chunked, {ChunkOf(r, 0, 5)});
  RunBatch(*chunked, {ChunkOf(r, 5, 13)});
  RunBatch(*chunked, {ChunkOf(r, 13, 21)});
  const std::vector<ForwardResult> last = RunBatch(*chunked, {ChunkOf(r, 21, 22)});  // a decode
  RequireSame(whole[0], last[0]);
  REQUIRE(AllPages(one_shot->kv_cache(), r) == AllPages(chunked->kv_cache(), r));
}

// Two requests batched (a prefill chunk each, then a decode of one beside the other's next
// chunk of `len_a - 11` tokens) on 3 threads give each request's results and pages alone on 1.
inline void RequireBatchedEqualsAlone(const ModelConfig& c, int32_t len_a) {
  INFO(c.ToString());
  int32_t next_page = 0;
  Request a = MakeRequest(c, 21, len_a, &next_page), b = MakeRequest(c, 22, 9, &next_page);
  auto together = MakeWithThreads(c, 3);
  const std::vector<ForwardResult> both =
      RunBatch(*together, {ChunkOf(a, 0, 11), ChunkOf(b, 0, 9)});
  const std::vector<ForwardResult> next =
      RunBatch(*together, {ChunkOf(b, 8, 9), ChunkOf(a, 11, len_a)});  // b re-decodes its last
  auto alone = MakeWithThreads(c, 1);
  RequireSame(RunBatch(*alone, {ChunkOf(a, 0, 11)})[0], both[0]);
  RequireSame(RunBatch(*alone, {ChunkOf(b, 0, 9)})[0], both[1]);
  RequireSame(RunBatch(*alone, {ChunkOf(b, 8, 9)})[0], next[0]);
  RequireSame(RunBatch(*alone, {ChunkOf(a, 11, len_a)})[0], next[1]);
  REQUIRE(AllPages(together->kv_cache(), a) == AllPages(alone->kv_cache(), a));
  REQUIRE(AllPages(together->kv_cache(), b) == AllPages(alone->kv_cache(), b));
}

struct RankRun {
  std::unique_ptr<Model> model;
  std::vector<std::vector<ForwardResult>> results;  // per step
  Status status;
};

// Two requests (state slots 0 and 1), prefilled in two chunks each (one chunk ends inside a
// page, so the next writes into a half-filled page) and then decoded for four steps, with the
// tokens fixed in advance, on tp x pp ranks (one thread each, `threads` workers per rank).
// Pages start at 3, not at the pool's beginning.
inline std::vector<RankRun> RunSharded(const ModelConfig& c, int32_t tp, int32_t pp,
                                       int32_t threads, std::vector<Request>* requests) {
  StatusOr<ModelWeights> weights = ModelWeights::Random(c, 7);
  REQUIRE(weights.ok());
  int32_t next_page = 3;
  requests->clear();
  requests->push_back(MakeRequest(c, 81, 27, &next_page));
  requests->push_back(MakeRequest(c, 82, 18, &next_page));
  (*requests)[1].state_slot = 1;
  using Step = std::vector<std::pair<int32_t, std::pair<int32_t, int32_t>>>;  // request, range
  std::vector<Step> steps = {{{0, {0, 10}}, {1, {0, 6}}}, {{0, {10, 23}}, {1, {6, 14}}}};
  for (int32_t d = 0; d < 4; ++d) steps.push_back({{0, {23 + d, 24 + d}}, {1, {14 + d, 15 + d}}});
  std::vector<std::unique_ptr<ModelComm>> comms = CreateInProcessModelComms(tp, pp);
  REQUIRE(comms.size() == static_cast<size_t>(tp * pp));
  std::vector<RankRun> runs(static_cast<size_t>(tp * pp));
  for (int32_t p = 0; p < pp; ++p) {
    for (int32_t t = 0; t < tp; ++t) {
      RuntimeOptions o = TestOptions();
      o.num_threads = threads;
      o.shard = {tp, t, pp, p};
      o.comm = tp * pp > 1 ? comms[static_cast<size_t>(o.shard.index())].get() : nullptr;
      StatusOr<std::unique_ptr<Model>> model = Model::Create(*weights, o);
      INFO(model.status().ToString());
      REQUIRE(model.ok());
      runs[static_cast<size_t>(o.shard.index())].model = std::move(model).value();
    }
  }
  std::vector<std::thread> rank_threads;
  for (RankRun& run : runs) {
    rank_threads.emplace_back([&run, &steps, requests] {
      for (const Step& step : steps) {
        std::vector<SequenceChunk> batch;
        for (const auto& [req, range] : step) {
          batch.push_back(
              ChunkOf((*requests)[static_cast<size_t>(req)], range.first, range.second));
        }
        std::vector<ForwardResult> results;
        run.status = run.model->Forward(batch, FullOptions(), &results);
        if (!run.status.ok()) return;
        run.results.push_back(std::move(results));
      }
    });
  }
  for (std::thread& t : rank_threads) t.join();
  for (const RankRun& run : runs) {
    INFO(run.status.ToString());
    REQUIRE(run.status.ok());
  }
  return runs;
}

// `mine` (one page of a rank's pool) holds exactly the rank's KV heads of `whole` (the same
// page of the whole model's pool); for MLA the whole latent row.
inline void RequireHeadSlice(const ModelConfig& c, const ShardLayout& layout,
                             const ModelConfig& mine_config, const std::vector<std::byte>& whole,
                             const std::vector<std::byte>& mine) {
  if (c.is_mla()) {
    REQUIRE(whole == mine);
    return;
  }
  const size_t elem = c.kv_elem_bytes();
  const size_t head_bytes = static_cast<size_t>(c.head_dim) * elem;
  for (int32_t t = 0; t < c.page_size; ++t) {
    for (int32_t h = 0; h < layout.kv_head_count; ++h) {
      const size_t from = KVOffsetInPage(c, t, layout.kv_head_start + h, 0) * elem;
      const size_t to = KVOffsetInPage(mine_config, t, h, 0) * elem;
      REQUIRE(std::memcmp(whole.data() + from, mine.data() + to, head_bytes) == 0);
    }
  }
}

// Every rank of a tp x pp split returns the whole model's results, and its pools hold exactly
// its share of the whole model's, for its stage's layers: its KV heads of every KV and SWA page
// (MLA: the whole latent row), the index pages and the recurrent state whole (replicated).
inline void RequireShardsMatchWhole(const ModelConfig& c, int32_t tp, int32_t pp) {
  std::vector<Request> requests;
  std::vector<RankRun> whole = RunSharded(c, 1, 1, 2, &requests);
  std::vector<RankRun> split = RunSharded(c, tp, pp, 1, &requests);
  const KVCache& full = whole[0].model->kv_cache();
  for (const RankRun& rank : split) {
    const ShardLayout& layout = rank.model->shard_layout();
    INFO("rank " << layout.shard.ToString() << " of " << c.ToString());
    REQUIRE(rank.results.size() == whole[0].results.size());
    for (size_t step = 0; step < rank.results.size(); ++step) {
      REQUIRE(rank.results[step].size() == whole[0].results[step].size());
      for (size_t i = 0; i < rank.results[step].size(); ++i) {
        RequireSame(rank.results[step][i], whole[0].results[step][i]);
      }
    }
    const KVCache& mine = rank.model->kv_cache();
    REQUIRE(mine.num_kv_layers() == layout.kv_count);
    REQUIRE(mine.num_swa_layers() == layout.swa_count);
    REQUIRE(mine.num_state_layers() == layout.state_count);
    REQUIRE(mine.num_index_layers() == (c.has_indexer() ? layout.kv_count : 0));
    REQUIRE(mine.config().num_kv_heads == layout.kv_head_count);
    std::vector<std::byte> a(full.config().kv_page_bytes()), b(mine.config().kv_page_bytes());
    for (const Request& r : requests) {
      for (int32_t page : r.pages) {
        for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
          for (int32_t l = 0; l < layout.kv_count; ++l) {
            if (c.is_mla() && kind == KVKind::kValue) continue;  // one latent pool per layer
            REQUIRE(full.ReadPage(kind, layout.kv_start + l, page, a).ok());
            REQUIRE(mine.ReadPage(kind, l, page, b).ok());
            RequireHeadSlice(c, layout, mine.config(), a, b);
          }
          for (int32_t l = 0; l < layout.swa_count; ++l) {
            REQUIRE(full.ReadSwaPage(kind, layout.swa_start + l, page, a).ok());
            REQUIRE(mine.ReadSwaPage(kind, l, page, b).ok());
            RequireHeadSlice(c, layout, mine.config(), a, b);
          }
        }
        for (int32_t l = 0; c.has_indexer() && l < layout.kv_count; ++l) {
          std::vector<std::byte> x(c.index_page_bytes()), y(c.index_page_bytes());
          REQUIRE(full.ReadIndexPage(layout.kv_start + l, page, x).ok());
          REQUIRE(mine.ReadIndexPage(l, page, y).ok());
          REQUIRE(x == y);
        }
      }
      for (int32_t l = 0; l < layout.state_count; ++l) {
        std::vector<float> x(static_cast<size_t>(c.state_dim())), y(x.size());
        REQUIRE(full.ReadState(layout.state_start + l, r.state_slot, x).ok());
        REQUIRE(mine.ReadState(l, r.state_slot, y).ok());
        REQUIRE(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
      }
    }
  }
}

}  // namespace pdlib::kernels::testing

#endif  // PDLIB_TEST_KERNELS_KERNEL_SHARD_HARNESS_H_
