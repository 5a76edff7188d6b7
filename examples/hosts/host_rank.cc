#include "examples/hosts/host_rank.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "examples/hosts/colocated.h"
#include "examples/hosts/sharding.h"
#include "examples/scheduler/decode_scheduler.h"
#include "examples/scheduler/kernels_runner.h"
#include "examples/scheduler/pools.h"
#include "examples/scheduler/prefill_scheduler.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {
namespace {

// The scheduler's ModelRunner over a sharded model: a failed forward pass aborts the model's
// group, so that no other rank of the host stays blocked in a collective this rank left.
class RankRunner final : public sched::ModelRunner {
 public:
  RankRunner(kernels::Model* model, kernels::ModelComm* comm) : inner_(model), comm_(comm) {}

  Status Forward(std::span<const sched::ForwardChunk> batch,
                 std::vector<sched::ForwardOutput>* results) override {
    return ForwardStreaming(batch, {}, results);
  }
  Status ForwardStreaming(std::span<const sched::ForwardChunk> batch,
                          const std::function<void(int32_t)>& kv_layers_done,
                          std::vector<sched::ForwardOutput>* results) override {
    Status s = inner_.ForwardStreaming(batch, kv_layers_done, results);
    if (!s.ok() && comm_ != nullptr) comm_->Abort(s);
    return s;
  }
  StatusOr<sched::HostKV> OffloadKV(std::span<const int32_t> page_table, int64_t num_tokens,
                                    int32_t state_slot) override {
    return inner_.OffloadKV(page_table, num_tokens, state_slot);
  }
  Status RestoreKV(const sched::HostKV& kv, std::span<const int32_t> page_table,
                   int32_t state_slot) override {
    return inner_.RestoreKV(kv, page_table, state_slot);
  }
  uint64_t kv_bytes_per_page() const { return inner_.kv_bytes_per_page(); }
  uint64_t page_state_bytes_per_page() const { return inner_.page_state_bytes_per_page(); }

 private:
  sched::KernelsModelRunner inner_;
  kernels::ModelComm* comm_;
};

// The test-only faults (HostOptions::test_fault, sharding.h): "swap-heads" corrupts every page of
// every KV and sliding-window pool that holds the request's received tokens; "swap-index" only
// the pages of the indexers' key pools.
void CorruptReceivedKV(kernels::KVCache& cache, const std::string& fault, uint64_t room,
                       std::span<const int32_t> table, int64_t num_tokens) {
  const kernels::ModelConfig& c = cache.config();
  const int32_t pages = std::min(kernels::PagesForTokens(num_tokens, c.page_size),
                                 static_cast<int32_t>(table.size()));
  std::vector<std::byte> buf;
  auto corrupt = [&](bool swa, kernels::KVKind kind, int32_t layer, size_t page_bytes) {
    buf.resize(page_bytes);
    for (int32_t i = 0; i < pages; ++i) {
      const int32_t page = table[static_cast<size_t>(i)];
      Status s =
          swa ? cache.ReadSwaPage(kind, layer, page, buf) : cache.ReadPage(kind, layer, page, buf);
      if (s.ok()) {
        CorruptReceivedPage(c, kind, buf);
        s = swa ? cache.WriteSwaPage(kind, layer, page, buf)
                : cache.WritePage(kind, layer, page, buf);
      }
      if (!s.ok()) {
        std::fprintf(stderr, "pd-decode: test fault: room %llu: %s\n",
                     static_cast<unsigned long long>(room), s.ToString().c_str());
        return;
      }
    }
  };
  if (fault == kTestFaultSwapIndex) {
    for (int32_t l = 0; l < cache.num_index_layers(); ++l) {
      buf.resize(c.index_page_bytes());
      for (int32_t i = 0; i < pages; ++i) {
        const int32_t page = table[static_cast<size_t>(i)];
        Status s = cache.ReadIndexPage(l, page, buf);
        if (s.ok()) {
          CorruptReceivedIndexPage(c, buf);
          s = cache.WriteIndexPage(l, page, buf);
        }
        if (!s.ok()) {
          std::fprintf(stderr, "pd-decode: test fault: room %llu: %s\n",
                       static_cast<unsigned long long>(room), s.ToString().c_str());
          return;
        }
      }
    }
    return;
  }
  for (kernels::KVKind kind : {kernels::KVKind::kKey, kernels::KVKind::kValue}) {
    for (int32_t l = 0; l < cache.num_kv_layers(); ++l) {
      const kernels::PoolRegion p = cache.pool(kind, l);
      if (p.base != nullptr && p.item_bytes > 0) corrupt(false, kind, l, p.item_bytes);
    }
    for (int32_t l = 0; l < cache.num_swa_layers(); ++l) {
      const kernels::PoolRegion p = cache.swa_pool(kind, l);
      if (p.base != nullptr && p.item_bytes > 0) corrupt(true, kind, l, p.item_bytes);
    }
  }
}

std::string RankName(Role role, int32_t tp_rank, int32_t pp_rank) {
  return std::string(RoleName(role)) + " rank tp " + std::to_string(tp_rank) + " pp " +
         std::to_string(pp_rank);
}

}  // namespace

StatusOr<kernels::ModelConfig> ModelConfigByName(const std::string& name) {
  if (name == "small") return kernels::ModelConfig::Small();
  if (name == "small-hybrid") return kernels::ModelConfig::SmallHybrid();
  if (name == "small-mla") return kernels::ModelConfig::SmallMla();
  if (name == "small-swa") return kernels::ModelConfig::SmallSwa();
  if (name == "small-nsa") return kernels::ModelConfig::SmallNsa();
  return Status::InvalidArgument("unknown model '" + name +
                                 "' (known: small, small-hybrid, small-mla, small-swa, small-nsa)");
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
  uint64_t state_bytes = 0;
  // Declared in construction order; destroyed in reverse: the scheduler (and every pdlib handle
  // it holds) before the manager, the manager before the memory it registered.
  std::unique_ptr<kernels::Model> model;
  std::unique_ptr<MetadataBuffers> metadata;
  std::unique_ptr<sched::PageAllocator> pages;
  std::unique_ptr<RankRunner> runner;
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
  rep->state_bytes =
      static_cast<uint64_t>(config.num_recurrent_layers()) * config.state_slot_bytes();

  // Decode keeps up to max_running running requests plus as many pre-allocated ones.
  const bool prefill = options.role == Role::kPrefill;
  const int32_t request_slots = prefill ? options.max_running : 2 * options.max_running;
  const int32_t ranks = options.tp_size * options.pp_size;
  kernels::RuntimeOptions runtime;
  runtime.device = options.device;
  runtime.cuda_device = options.cuda_device;
  runtime.num_pages = options.num_pages;
  runtime.num_state_slots = std::max(1, request_slots);
  runtime.num_threads =
      options.threads_per_rank > 0
          ? options.threads_per_rank
          : std::max(1, static_cast<int32_t>(std::thread::hardware_concurrency()) / ranks);
  runtime.shard = {.tp_size = options.tp_size,
                   .tp_rank = placement.tp_rank,
                   .pp_size = options.pp_size,
                   .pp_rank = placement.pp_rank};
  runtime.comm = placement.comm;
  auto model = kernels::Model::Create(weights, runtime);
  if (!model.ok()) return fail(model.status(), "model");
  rep->model = std::move(*model);
  auto metadata = MetadataBuffers::Create(MetadataBuffers::SlotCountFor(request_slots), 0, 0);
  if (!metadata.ok()) return fail(metadata.status(), "metadata buffers");
  rep->metadata = std::move(*metadata);
  rep->pages = std::make_unique<sched::PageAllocator>(options.num_pages, config.page_size);
  kernels::KVCache& cache = rep->model->kv_cache();
  rep->runner = std::make_unique<RankRunner>(rep->model.get(), placement.comm);

  // What this rank registers with pdlib: its own cache's pools, which hold exactly its share of
  // the model (sharding.h). The seed is part of the name: two hosts with different weights must
  // not pair.
  auto args = RankKVArgs(rep->model->config(), rep->model->shard_layout(), cache,
                         "pd-example-" + options.model + "-seed" + std::to_string(options.seed));
  if (!args.ok()) return fail(args.status(), "pdlib registration");
  args->aux = rep->metadata->Describe();
  // GPU pools (kCuda, from the cache) live on the rank's device; the metadata slots stay in host
  // memory.
  args->device_id = options.cuda_device;
  uint64_t kv_bytes_per_page = rep->runner->kv_bytes_per_page();
  uint64_t page_state_bytes_per_page = rep->runner->page_state_bytes_per_page();

  if (options.role != Role::kColocated) {
    KVManagerOptions mo;
    mo.mode = prefill ? Mode::kPrefill : Mode::kDecode;
    mo.args = std::move(*args);
    mo.control_plane = options.control_plane;
    mo.backend = options.backend;
    mo.backend_options = options.backend_options;
    mo.direction = options.direction;
    mo.listen_host = options.listen_host;
    mo.bootstrap_host = placement.bootstrap.host;
    mo.bootstrap_port = placement.bootstrap.port;
    mo.start_bootstrap_server = placement.start_bootstrap;
    mo.bootstrap_timeout = options.bootstrap_timeout;
    mo.waiting_timeout = options.waiting_timeout;
    mo.transfer_timeout = options.transfer_timeout;
    mo.liveness_timeout = options.liveness_timeout;
    mo.connect_timeout = options.connect_timeout;
    mo.discovery = options.discovery;
    mo.etcd_endpoints = options.etcd_endpoints;
    mo.etcd_prefix = options.etcd_prefix;
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
    rep->colocated = std::make_unique<ColocatedTransport>(rep->model.get(), rep->metadata.get(),
                                                          std::max(1, options.chunked_prefill_size),
                                                          placement.comm);
    kv_bytes_per_page = page_state_bytes_per_page = 0;  // nothing moves
  }

  const int32_t sliding_window = config.has_sliding_window() ? config.sliding_window : 0;
  if (prefill) {
    sched::PrefillSchedulerOptions so;
    so.max_running_requests = options.max_running;
    so.chunked_prefill_size = options.chunked_prefill_size;
    so.max_context_len = options.max_context_len;
    so.vocab_size = config.vocab_size;
    so.num_state_slots = config.is_hybrid() ? request_slots : 0;
    so.sliding_window = sliding_window;
    so.whole_sequence_state = config.has_indexer();
    so.kv_bytes_per_page = kv_bytes_per_page;
    so.page_state_bytes_per_page = page_state_bytes_per_page;
    so.layerwise = options.layerwise;
    so.direction = options.direction;
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
    // The colocated host recomputes every prompt: nothing to reuse across a transfer.
    so.prefix_cache_pages = rep->colocated ? 0 : options.prefix_cache_pages;
    so.num_state_slots = config.is_hybrid() ? request_slots : 0;
    so.sliding_window = sliding_window;
    so.whole_sequence_state = config.has_indexer();
    so.vocab_size = config.vocab_size;
    so.kv_bytes_per_page = kv_bytes_per_page;
    so.page_state_bytes_per_page = page_state_bytes_per_page;
    so.group = placement.group;
    Rep* r = rep.get();
    so.on_token = [r](uint64_t room, int32_t index, int32_t token) {
      r->tokens.push_back({room, index, token});
    };
    if (!options.test_fault.empty() && placement.tp_rank == 0 && placement.pp_rank == 0) {
      std::fprintf(stderr,
                   "pd-decode: TEST FAULT %s: rank tp 0 pp 0 corrupts every request's received "
                   "%s; outputs will be wrong\n",
                   options.test_fault.c_str(),
                   options.test_fault == kTestFaultSwapIndex ? "index keys" : "KV");
      so.on_kv_arrived = [r, fault = options.test_fault](
                             uint64_t room, std::span<const int32_t> table, int64_t tokens) {
        CorruptReceivedKV(r->model->kv_cache(), fault, room, table, tokens);
      };
    }
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
