#include "examples/hosts/host_rank.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>

#include "examples/hosts/colocated.h"
#include "examples/scheduler/decode_scheduler.h"
#include "examples/scheduler/kernels_runner.h"
#include "examples/scheduler/pools.h"
#include "examples/scheduler/prefill_scheduler.h"
#include "pdlib/kv_pool.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {
namespace {

// A prefill rank with TP > 1 registers shard pools (sharding.h). After every forward pass this
// runner copies the head slice of each page the pass wrote, for the stage's layers, from the
// replica's full pool into the shard pool, before the scheduler hands the pages to pdlib.
class ShardingRunner final : public sched::ModelRunner {
 public:
  struct ShardPool {
    kernels::KVKind kind;
    int32_t kv_layer;
    std::byte* base;
  };
  ShardingRunner(kernels::Model* model, const StageLayout& layout, std::vector<ShardPool> pools)
      : model_(model), inner_(model), layout_(layout), pools_(std::move(pools)) {}

  Status Forward(std::span<const sched::ForwardChunk> batch,
                 std::vector<sched::ForwardOutput>* results) override {
    if (Status s = inner_.Forward(batch, results); !s.ok()) return s;
    const kernels::ModelConfig& config = model_->config();
    const size_t full_bytes = config.kv_page_bytes();
    const size_t shard_bytes = ShardPageBytes(config, layout_.head_count);
    for (const sched::ForwardChunk& c : batch) {
      const PageSpan span =
          PagesWritten(c.start_pos, static_cast<int32_t>(c.tokens.size()), config.page_size);
      for (int32_t i = span.first; i <= span.last; ++i) {
        const auto page = static_cast<size_t>(c.page_table[static_cast<size_t>(i)]);
        for (const ShardPool& p : pools_) {
          const kernels::PoolRegion full = model_->kv_cache().pool(p.kind, p.kv_layer);
          CopyHeadShard(config, layout_.head_start, layout_.head_count,
                        {static_cast<const std::byte*>(full.base) + page * full_bytes, full_bytes},
                        {p.base + page * shard_bytes, shard_bytes});
        }
      }
    }
    return Status::OK();
  }

 private:
  kernels::Model* model_;
  sched::KernelsModelRunner inner_;
  StageLayout layout_;
  std::vector<ShardPool> pools_;
};

std::string RankName(Role role, int32_t tp_rank, int32_t pp_rank) {
  return std::string(RoleName(role)) + " rank tp " + std::to_string(tp_rank) + " pp " +
         std::to_string(pp_rank);
}

}  // namespace

StatusOr<kernels::ModelConfig> ModelConfigByName(const std::string& name) {
  if (name == "small") return kernels::ModelConfig::Small();
  if (name == "small-hybrid") return kernels::ModelConfig::SmallHybrid();
  return Status::InvalidArgument("unknown model '" + name + "' (known: small, small-hybrid)");
}

void RankStepOutput::Clear() {
  added.clear();
  step = Status::OK();
  finished.clear();
  tokens.clear();
  idle = true;
  forwarded = false;
  running = queued = 0;
}

struct HostRank::Rep {
  Role role = Role::kPrefill;
  StageLayout layout;
  uint64_t state_bytes = 0;
  // Declared in construction order; destroyed in reverse: the scheduler (and every pdlib handle
  // it holds) before the manager, the manager before the memory it registered.
  std::unique_ptr<kernels::Model> model;
  std::unique_ptr<MetadataBuffers> metadata;
  std::unique_ptr<KVPool> shard_pool;
  std::unique_ptr<sched::PageAllocator> pages;
  std::unique_ptr<sched::ModelRunner> runner;
  std::unique_ptr<KVManager> manager;
  std::unique_ptr<sched::KVManagerTransport> transport;
  std::unique_ptr<ColocatedTransport> colocated;
  std::vector<RankStepOutput::Token> tokens;  // filled by the decode scheduler's on_token
  std::unique_ptr<sched::PrefillScheduler> prefill;
  std::unique_ptr<sched::DecodeScheduler> decode;
};

StatusOr<std::unique_ptr<HostRank>> HostRank::Create(const HostOptions& options,
                                                     const kernels::ModelWeights& weights,
                                                     const RankPlacement& placement) {
  const std::string name = RankName(options.role, placement.tp_rank, placement.pp_rank);
  auto fail = [&](const Status& s, const char* what) { return s.WithPrefix(name + ": " + what); };
  const kernels::ModelConfig& config = weights.config;
  auto rep = std::make_unique<Rep>();
  rep->role = options.role;
  auto layout = MakeStageLayout(config, options.tp_size, placement.tp_rank, options.pp_size,
                                placement.pp_rank);
  if (!layout.ok()) return fail(layout.status(), "model split");
  rep->layout = *layout;
  rep->state_bytes =
      static_cast<uint64_t>(config.num_recurrent_layers()) * config.state_slot_bytes();

  // Decode keeps up to max_running running requests plus as many pre-allocated ones.
  const bool prefill = options.role == Role::kPrefill;
  const int32_t request_slots = prefill ? options.max_running : 2 * options.max_running;
  const int32_t ranks = options.tp_size * options.pp_size;
  kernels::RuntimeOptions runtime;
  runtime.num_pages = options.num_pages;
  runtime.num_state_slots = std::max(1, request_slots);
  runtime.num_threads =
      options.threads_per_rank > 0
          ? options.threads_per_rank
          : std::max(1, static_cast<int32_t>(std::thread::hardware_concurrency()) / ranks);
  auto model = kernels::Model::Create(weights, runtime);
  if (!model.ok()) return fail(model.status(), "model");
  rep->model = std::move(*model);
  auto metadata = MetadataBuffers::Create(MetadataBuffers::SlotCountFor(request_slots), 0, 0);
  if (!metadata.ok()) return fail(metadata.status(), "metadata buffers");
  rep->metadata = std::move(*metadata);
  rep->pages = std::make_unique<sched::PageAllocator>(options.num_pages, config.page_size);
  kernels::KVCache& cache = rep->model->kv_cache();

  // What this rank registers with pdlib (sharding.h): its stage's K pools then V pools, whole or
  // as head shards, and its stage's state pools.
  KVArgs args;
  uint64_t kv_bytes_per_page = 0;
  if (prefill && options.tp_size > 1) {
    const size_t shard_page = ShardPageBytes(config, layout->head_count);
    const uint64_t buffer_bytes = shard_page * static_cast<uint64_t>(options.num_pages);
    auto pool = AllocateKVPool(options.backend, 2 * layout->kv_count * buffer_bytes,
                               MemoryKind::kHost, options.backend_options);
    if (!pool.ok()) return fail(pool.status(), "shard KV pool");
    rep->shard_pool = std::move(*pool);
    std::vector<ShardingRunner::ShardPool> shards;
    auto* base = static_cast<std::byte*>(rep->shard_pool->data());
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      for (int32_t i = 0; i < layout->kv_count; ++i) {
        shards.push_back({kind, layout->kv_start + i, base});
        args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(base));
        args.kv.lens.push_back(buffer_bytes);
        args.kv.item_lens.push_back(shard_page);
        base += buffer_bytes;
      }
    }
    kv_bytes_per_page = 2ull * static_cast<uint64_t>(layout->kv_count) * shard_page;
    rep->runner = std::make_unique<ShardingRunner>(rep->model.get(), *layout, std::move(shards));
  } else {
    for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
      for (int32_t i = 0; i < layout->kv_count; ++i) {
        const kernels::PoolRegion p = cache.pool(kind, layout->kv_start + i);
        args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(p.base));
        args.kv.lens.push_back(p.bytes);
        args.kv.item_lens.push_back(p.item_bytes);
      }
    }
    kv_bytes_per_page = 2ull * static_cast<uint64_t>(layout->kv_count) * config.kv_page_bytes();
    rep->runner = std::make_unique<sched::KernelsModelRunner>(rep->model.get());
  }
  for (int32_t i = 0; i < layout->state_count; ++i) {
    const kernels::PoolRegion p = cache.state_pool(layout->state_start + i);
    args.state.ptrs.push_back(reinterpret_cast<uint64_t>(p.base));
    args.state.lens.push_back(p.bytes);
    args.state.item_lens.push_back(p.item_bytes);
    args.state_dim_per_tensor.push_back(-1);  // replicated: the primary TP rank sends it
  }
  args.state_type = config.is_hybrid() ? StateType::kMamba : StateType::kNone;
  args.state_start = layout->state_start;
  args.aux = rep->metadata->Describe();
  args.page_size = static_cast<uint32_t>(config.page_size);
  args.kv_head_num = layout->head_count;
  args.kv_layout = config.kv_layout;
  args.memory_kind = cache.memory_kind();
  args.parallel.tp_size = options.tp_size;
  args.parallel.tp_rank = placement.tp_rank;
  args.parallel.pp_size = options.pp_size;
  args.parallel.pp_rank = placement.pp_rank;
  args.prefill_start_layer = layout->kv_start;
  // The seed is part of the name: two hosts with different weights must not pair.
  args.fingerprint =
      config.Fingerprint("pd-example-" + options.model + "-seed" + std::to_string(options.seed));

  if (options.role != Role::kColocated) {
    KVManagerOptions mo;
    mo.mode = prefill ? Mode::kPrefill : Mode::kDecode;
    mo.args = std::move(args);
    mo.control_plane = options.control_plane;
    mo.backend = options.backend;
    mo.backend_options = options.backend_options;
    mo.listen_host = options.listen_host;
    mo.bootstrap_host = placement.bootstrap.host;
    mo.bootstrap_port = placement.bootstrap.port;
    mo.start_bootstrap_server = placement.start_bootstrap;
    mo.bootstrap_timeout = options.bootstrap_timeout;
    mo.waiting_timeout = options.waiting_timeout;
    mo.transfer_timeout = options.transfer_timeout;
    mo.liveness_timeout = options.liveness_timeout;
    mo.connect_timeout = options.connect_timeout;
    auto manager = KVManager::Create(mo);
    if (!manager.ok()) return fail(manager.status(), "KVManager::Create");
    rep->manager = std::move(*manager);
    rep->transport = std::make_unique<sched::KVManagerTransport>(rep->manager.get());
    // Warm-up: a prefill deployment named at start is connected to before the first request.
    for (const std::string& where : options.connect) {
      const size_t colon = where.rfind(':');
      BootstrapAddress address{where.substr(0, colon),
                               static_cast<uint16_t>(std::atoi(where.c_str() + colon + 1))};
      if (Status s = rep->manager->Connect(address, options.connect_timeout); !s.ok()) {
        std::fprintf(stderr, "pd-decode: warm-up of %s failed (requests will connect): %s\n",
                     where.c_str(), s.ToString().c_str());
      }
    }
  } else {
    rep->colocated = std::make_unique<ColocatedTransport>(
        rep->model.get(), rep->metadata.get(), std::max(1, options.chunked_prefill_size));
    kv_bytes_per_page = 0;  // nothing moves
  }

  if (prefill) {
    sched::PrefillSchedulerOptions so;
    so.max_running_requests = options.max_running;
    so.chunked_prefill_size = options.chunked_prefill_size;
    so.max_context_len = options.max_context_len;
    so.num_state_slots = config.is_hybrid() ? request_slots : 0;
    so.kv_bytes_per_page = kv_bytes_per_page;
    so.group = placement.group;
    auto s = sched::PrefillScheduler::Create(
        so, {rep->pages.get(), rep->metadata.get(), rep->transport.get(), rep->runner.get()});
    if (!s.ok()) return fail(s.status(), "prefill scheduler");
    rep->prefill = std::move(*s);
  } else {
    sched::DecodeSchedulerOptions so;
    so.max_running_requests = options.max_running;
    so.pre_alloc_size = options.max_running;
    so.max_context_len = options.max_context_len;
    so.reserved_decode_tokens = options.reserved_decode_tokens;
    so.num_state_slots = config.is_hybrid() ? request_slots : 0;
    so.vocab_size = config.vocab_size;
    so.kv_bytes_per_page = kv_bytes_per_page;
    so.group = placement.group;
    Rep* r = rep.get();
    so.on_token = [r](uint64_t room, int32_t index, int32_t token) {
      r->tokens.push_back({room, index, token});
    };
    sched::ReceiverFactory* receivers =
        rep->colocated ? static_cast<sched::ReceiverFactory*>(rep->colocated.get())
                       : rep->transport.get();
    auto s = sched::DecodeScheduler::Create(
        so, {rep->pages.get(), rep->metadata.get(), receivers, rep->runner.get()});
    if (!s.ok()) return fail(s.status(), "decode scheduler");
    rep->decode = std::move(*s);
  }
  return std::unique_ptr<HostRank>(new HostRank(std::move(rep)));
}

HostRank::HostRank(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

HostRank::~HostRank() {
  // Handles before their manager (kv_manager.h); members would go in this order anyway, but the
  // order matters enough to spell out.
  rep_->prefill.reset();
  rep_->decode.reset();
  rep_->transport.reset();
  rep_->manager.reset();
}

uint64_t HostRank::state_bytes() const { return rep_->state_bytes; }

void HostRank::Step(std::span<const sched::Request> batch, RankStepOutput* out) {
  out->Clear();
  Rep& r = *rep_;
  for (const sched::Request& req : batch) {
    if (r.prefill) {
      out->added.push_back(r.prefill->AddRequest(req));
      continue;
    }
    if (r.colocated) r.colocated->Expect(req.room, req.prompt);
    Status s = r.decode->AddRequest(req);
    if (!s.ok() && r.colocated) r.colocated->Forget(req.room);
    out->added.push_back(std::move(s));
  }
  const uint64_t passes_before =
      r.prefill ? r.prefill->metrics().forward_passes : r.decode->metrics().forward_passes;
  out->step = r.prefill ? r.prefill->Step() : r.decode->Step();
  const uint64_t passes_after =
      r.prefill ? r.prefill->metrics().forward_passes : r.decode->metrics().forward_passes;
  out->forwarded = passes_after != passes_before;
  Report(out);
}

void HostRank::FailAll(const Status& why, RankStepOutput* out) {
  out->Clear();
  if (rep_->prefill) rep_->prefill->FailAll(why);
  if (rep_->decode) rep_->decode->FailAll(why);
  Report(out);
}

void HostRank::Report(RankStepOutput* out) {
  Rep& r = *rep_;
  // Page reuse (kv_manager.h): the scheduler keeps a failed request's handle, and its pages, until
  // PagesReusable(), so every room pdlib lists here has already been freed. Drained only so that
  // pdlib's list of released rooms does not fill up (it logs an ERROR past 65536).
  if (r.manager) r.manager->TakeReusableRooms();
  out->tokens.swap(r.tokens);
  r.tokens.clear();
  if (r.prefill) {
    out->finished = r.prefill->TakeFinished();
    out->idle = r.prefill->idle();
    out->running =
        static_cast<int32_t>(r.prefill->waiting_queue_size() + r.prefill->inflight_queue_size());
    out->queued = static_cast<int32_t>(r.prefill->bootstrap_queue_size());
  } else {
    out->finished = r.decode->TakeFinished();
    out->idle = r.decode->idle();
    out->running = static_cast<int32_t>(r.decode->running_size() + r.decode->waiting_queue_size() +
                                        r.decode->transfer_queue_size());
    out->queued =
        static_cast<int32_t>(r.decode->prealloc_queue_size() + r.decode->retracted_queue_size());
  }
}

}  // namespace pdlib::hosts
