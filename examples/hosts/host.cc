#include "examples/hosts/host.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

#include "examples/hosts/host_rank.h"
#include "examples/hosts/sharding.h"
#include "lib/control/bootstrap_server.h"
#include "pdlib/poll_reduce.h"
#include "pdlib_kernels/cuda_info.h"

namespace pdlib::hosts {
namespace {

int64_t NowUs() {
  // The schedulers' default clock (steady_clock in microseconds), so their timestamps compare.
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A reusable barrier for the coordinator and the rank threads (mutex and generation count:
// plain enough that ThreadSanitizer sees every edge).
class StepBarrier {
 public:
  explicit StepBarrier(int parties) : parties_(parties) {}
  void ArriveAndWait() {
    std::unique_lock lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  const int parties_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

// The scheduler's reason on a rank whose own handle is fine while another rank's failed
// (prefill_scheduler.cc / decode_scheduler.cc FailureOf): the other rank knows the real reason.
bool IsSecondHandReason(const Status& s) {
  return s.message().find("failed on another TP rank") != std::string_view::npos;
}

}  // namespace

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kPrefill: return "prefill";
    case Role::kDecode: return "decode";
    case Role::kColocated: return "colocated";
  }
  return "unknown";
}

Status ValidateHostOptions(const HostOptions& o) {
  auto config = ModelConfigByName(o.model);
  if (!config.ok()) return config.status();
  if (o.tp_size < 1 || o.pp_size < 1) {
    return Status::InvalidArgument("tp " + std::to_string(o.tp_size) + " and pp " +
                                   std::to_string(o.pp_size) + " must be >= 1");
  }
  // Every rank's share must exist (TP against the heads and widths, PP against the layers, a
  // full-attention layer in every stage); the first refusal names the numbers.
  for (int32_t pp = 0; pp < o.pp_size; ++pp) {
    for (int32_t tp = 0; tp < o.tp_size; ++tp) {
      auto layout = kernels::MakeShardLayout(
          *config, {.tp_size = o.tp_size, .tp_rank = tp, .pp_size = o.pp_size, .pp_rank = pp});
      if (!layout.ok()) {
        return layout.status().WithPrefix("model " + o.model + " with tp " +
                                          std::to_string(o.tp_size) + " pp " +
                                          std::to_string(o.pp_size));
      }
    }
  }
  if (o.cuda_device < 0) {
    return Status::InvalidArgument("cuda_device " + std::to_string(o.cuda_device) +
                                   " must be >= 0");
  }
  if (o.device == kernels::Device::kCuda &&
      (config->is_mla() || config->has_sliding_window() || config->has_indexer())) {
    // kernels::Model::Create's rule, checked here so that it is refused before any GPU is asked.
    const char* what = config->is_mla()               ? "MLA attention"
                       : config->has_sliding_window() ? "sliding-window attention"
                                                      : "a lightning indexer";
    return Status::InvalidArgument("device cuda: model " + o.model + " has " + what +
                                   ", which the CUDA model has no kernels for (it runs small "
                                   "and small-hybrid); use device cpu");
  }
  if (o.device != kernels::Device::kCpu && o.device != kernels::Device::kCuda) {
    return Status::InvalidArgument("device " + std::to_string(static_cast<int>(o.device)) +
                                   ": expected cpu or cuda");
  }
  if (!o.test_fault.empty()) {
    if (o.test_fault != kTestFaultSwapHeads && o.test_fault != kTestFaultSwapIndex) {
      return Status::InvalidArgument("test_fault '" + o.test_fault + "': known are '" +
                                     kTestFaultSwapHeads + "' and '" + kTestFaultSwapIndex + "'");
    }
    if (o.role == Role::kPrefill) {
      return Status::InvalidArgument("test_fault: decode hosts only");
    }
  }
  if (o.num_pages < 1 || o.max_running < 1 || o.chunked_prefill_size < 1 || o.max_context_len < 1 ||
      o.reserved_decode_tokens < 0 || o.threads_per_rank < 0) {
    return Status::InvalidArgument(
        "num_pages " + std::to_string(o.num_pages) + ", max_running " +
        std::to_string(o.max_running) + ", chunked_prefill_size " +
        std::to_string(o.chunked_prefill_size) + " and max_context_len " +
        std::to_string(o.max_context_len) + " must be >= 1; reserved_decode_tokens " +
        std::to_string(o.reserved_decode_tokens) + " and threads_per_rank " +
        std::to_string(o.threads_per_rank) + " >= 0");
  }
  if (o.idle_poll.count() < 0) return Status::InvalidArgument("idle_poll must be >= 0");
  return Status::OK();
}

struct Host::Rep {
  HostOptions options;
  BootstrapAddress bootstrap;
  std::unique_ptr<control::BootstrapServer> bootstrap_server;  // --start-bootstrap, port 0
  std::vector<std::unique_ptr<ProcessGroup>> group;
  // The model's collectives between the ranks (one member per rank); declared before the ranks,
  // whose models use them, so that they go after.
  std::vector<std::unique_ptr<kernels::ModelComm>> comms;
  std::vector<std::unique_ptr<HostRank>> ranks;
  uint64_t state_bytes = 0;

  // Handed from the coordinator to the ranks and back through the barrier: written by one side
  // before it arrives, read by the other after it leaves.
  enum class Command { kStep, kFailAll, kExit };
  Command command = Command::kStep;
  std::vector<sched::Request> batch;
  Status fail_reason;
  std::vector<RankStepOutput> outputs;
  std::unique_ptr<StepBarrier> barrier;
  std::vector<std::thread> rank_threads;
  std::thread coordinator;
  std::promise<void> coordinator_exit;
  std::future<void> coordinator_done = coordinator_exit.get_future();

  struct Pending {
    HostRequest request;
    RequestCallbacks callbacks;
    int64_t received_us = 0;
  };
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Pending> intake;  // guarded by mu
  bool stopping = false;       // guarded by mu
  HostLoad load;               // guarded by mu; refreshed after every step
  std::once_flag shutdown_once;

  // Coordinator thread only.
  struct Live {
    Pending pending;
    std::vector<std::optional<sched::FinishedRequest>> done;  // per rank
    size_t done_count = 0;
  };
  std::map<uint64_t, Live> live;

  void RankLoop(size_t index);
  void CoordinatorLoop();
  // Runs one command on every rank and collects the outputs.
  void RunOnRanks(Command command);
  // Reports what the ranks produced; returns a host-level fault, if any.
  Status Collect(const std::vector<Pending>& added);
  void Report(Live& l);
  void FailEverything(const Status& why);
};

void Host::Rep::RankLoop(size_t index) {
  while (true) {
    barrier->ArriveAndWait();  // the coordinator has set command, batch and fail_reason
    if (command == Command::kExit) return;
    if (command == Command::kStep) {
      ranks[index]->Step(batch, &outputs[index]);
    } else {
      ranks[index]->FailAll(fail_reason, &outputs[index]);
    }
    barrier->ArriveAndWait();  // the coordinator may read outputs
  }
}

void Host::Rep::RunOnRanks(Command c) {
  command = c;
  barrier->ArriveAndWait();
  barrier->ArriveAndWait();
}

void Host::Rep::CoordinatorLoop() {
  bool busy = false, forwarded = false;
  while (true) {
    std::vector<Pending> taken;
    {
      std::unique_lock lock(mu);
      auto ready = [&] { return stopping || !intake.empty(); };
      if (!busy) {
        cv.wait(lock, ready);
      } else if (!forwarded) {
        // Only waiting on the network: poll again soon, or at once when a request comes.
        cv.wait_for(lock, options.idle_poll, ready);
      }
      if (stopping) break;
      while (!intake.empty()) {
        taken.push_back(std::move(intake.front()));
        intake.pop_front();
      }
    }
    // A room already live here is refused before it reaches the schedulers: results are keyed
    // by room.
    batch.clear();
    std::vector<Pending> added;
    for (Pending& p : taken) {
      if (live.count(p.request.room) > 0 ||
          std::any_of(added.begin(), added.end(),
                      [&](const Pending& a) { return a.request.room == p.request.room; })) {
        HostRequestResult r;
        r.status = Status::AlreadyExists("room " + std::to_string(p.request.room) +
                                         " is already live on this host");
        if (p.callbacks.on_result) p.callbacks.on_result(std::move(r));
        continue;
      }
      batch.push_back({.room = p.request.room,
                       .prompt = p.request.prompt,
                       .max_new_tokens = p.request.max_new_tokens,
                       .bootstrap = p.request.bootstrap,
                       .prefill_dp_rank = p.request.prefill_dp_rank});
      added.push_back(std::move(p));
    }
    RunOnRanks(Command::kStep);
    if (Status fault = Collect(added); !fault.ok()) FailEverything(fault);
    busy = std::any_of(outputs.begin(), outputs.end(), [](const auto& o) { return !o.idle; });
    forwarded =
        std::any_of(outputs.begin(), outputs.end(), [](const auto& o) { return o.forwarded; });
    std::lock_guard lock(mu);
    load.running = outputs[0].running;
    load.queued = outputs[0].queued + static_cast<int32_t>(intake.size());
  }
  // Shutting down: every live request fails with a reason the peers are told, then the ranks
  // leave their loops.
  const Status why =
      Status::Unavailable(std::string(RoleName(options.role)) + " host is shutting down");
  FailEverything(why);
  std::deque<Pending> left;
  {
    std::lock_guard lock(mu);
    left.swap(intake);
  }
  for (Pending& p : left) {
    if (p.callbacks.on_result) p.callbacks.on_result(HostRequestResult::Failed(why));
  }
  command = Command::kExit;
  barrier->ArriveAndWait();
}

void Host::Rep::FailEverything(const Status& why) {
  if (!why.ok() && why.code() != StatusCode::kUnavailable) {
    std::fprintf(stderr, "pd-%s: host fault, failing every request: %s\n",
                 std::string(RoleName(options.role)).c_str(), why.ToString().c_str());
  }
  fail_reason = why;
  RunOnRanks(Command::kFailAll);
  if (Status again = Collect({}); !again.ok()) {
    std::fprintf(stderr, "pd-%s: %s\n", std::string(RoleName(options.role)).c_str(),
                 again.ToString().c_str());
  }
  // Whatever a rank did not report (it never held the request) fails here.
  for (auto& [room, l] : live) {
    if (l.pending.callbacks.on_result)
      l.pending.callbacks.on_result(HostRequestResult::Failed(why));
  }
  live.clear();
}

Status Host::Rep::Collect(const std::vector<Pending>& added) {
  Status fault;
  const size_t n = ranks.size();
  // Admission: every rank must have answered the same for each request.
  for (size_t k = 0; k < added.size(); ++k) {
    size_t accepted = 0;
    for (const RankStepOutput& o : outputs) accepted += o.added[k].ok() ? 1 : 0;
    const Pending& p = added[k];
    if (accepted == 0) {
      if (p.callbacks.on_result)
        p.callbacks.on_result(HostRequestResult::Failed(outputs[0].added[k]));
      continue;
    }
    live[p.request.room] = {p, std::vector<std::optional<sched::FinishedRequest>>(n), 0};
    if (accepted != n && fault.ok()) {
      fault = Status::Internal("room " + std::to_string(p.request.room) + " was accepted by " +
                               std::to_string(accepted) + " of " + std::to_string(n) + " ranks");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!outputs[i].step.ok() && fault.ok()) fault = outputs[i].step;
  }
  // Tokens: only decode produces them, and every rank the same ones (the model's last PP stage
  // hands every rank its results).
  for (const RankStepOutput::Token& t : outputs[0].tokens) {
    auto it = live.find(t.room);
    if (it != live.end() && it->second.pending.callbacks.on_token) {
      it->second.pending.callbacks.on_token(t.index, t.token);
    }
  }
  // A request is done when every rank finished it; in lockstep that is the same step.
  std::vector<uint64_t> order;
  for (size_t i = 0; i < n; ++i) {
    for (sched::FinishedRequest& f : outputs[i].finished) {
      auto it = live.find(f.room);
      if (it == live.end() || it->second.done[i]) continue;
      if (i == 0) order.push_back(f.room);
      it->second.done[i] = std::move(f);
      ++it->second.done_count;
    }
  }
  for (auto& [room, l] : live) {
    if (l.done_count > 0 && l.done_count < n && fault.ok()) {
      fault = Status::Internal("room " + std::to_string(room) + " finished on " +
                               std::to_string(l.done_count) + " of " + std::to_string(n) +
                               " ranks in one step");
    }
  }
  for (uint64_t room : order) {
    auto it = live.find(room);
    if (it != live.end() && it->second.done_count == n) {
      Report(it->second);
      live.erase(it);
    }
  }
  return fault;
}

void Host::Rep::Report(Live& l) {
  const int64_t t0 = l.pending.received_us;
  auto since = [t0](int64_t t) { return t == 0 ? int64_t{0} : std::max<int64_t>(0, t - t0); };
  const sched::FinishedRequest& first = *l.done[0];
  HostRequestResult r;
  r.output_ids = first.output_ids;
  r.first_token_us = since(first.first_token_us);
  int64_t start = 0, end = 0;
  bool ended = true;
  for (const auto& d : l.done) {
    if (!d->status.ok() && (r.status.ok() || IsSecondHandReason(r.status))) r.status = d->status;
    if (d->transfer_start_us != 0 && (start == 0 || d->transfer_start_us < start)) {
      start = d->transfer_start_us;
    }
    end = std::max(end, d->transfer_end_us);
    ended = ended && d->transfer_end_us != 0;
    if (options.role == Role::kPrefill && d->transfer_end_us != 0 && d->first_token_us != 0) {
      r.exposed_transfer_us = std::max(
          r.exposed_transfer_us, std::max<int64_t>(0, d->transfer_end_us - d->first_token_us));
    }
    r.kv_bytes += d->kv_bytes;
  }
  if (ended && start != 0) r.transfer_us = std::max<int64_t>(0, end - start);
  // Recurrent state travels once per request (the primary TP rank of each stage sends its
  // stage's share), with the KV.
  if (ended && options.role != Role::kColocated) r.kv_bytes += state_bytes;
  r.finish_us = since(NowUs());
  if (!r.status.ok()) r.output_ids.clear();
  if (l.pending.callbacks.on_result) l.pending.callbacks.on_result(std::move(r));
}

StatusOr<std::unique_ptr<Host>> Host::Create(const HostOptions& options) {
  if (Status s = ValidateHostOptions(options); !s.ok()) return s;
  if (options.device == kernels::Device::kCuda) {
    // Before any rank exists: a machine without a usable GPU says so once, with CUDA's reason.
    const kernels::CudaInfo cuda = kernels::ProbeCuda();
    if (cuda.device_count == 0) return Status::Unavailable("no CUDA device: " + cuda.reason);
    if (options.cuda_device >= cuda.device_count) {
      return Status::InvalidArgument("cuda_device " + std::to_string(options.cuda_device) +
                                     ": this machine has " + std::to_string(cuda.device_count) +
                                     " CUDA device(s)");
    }
  }
  auto config = ModelConfigByName(options.model);
  auto weights = kernels::ModelWeights::Random(*config, options.seed);
  if (!weights.ok()) return weights.status().WithPrefix("model weights");

  auto rep = std::make_unique<Rep>();
  rep->options = options;
  rep->bootstrap = {options.bootstrap_host, options.bootstrap_port};
  bool manager_bootstrap = false;
  if (options.role == Role::kPrefill && options.start_bootstrap &&
      options.control_plane == ControlPlane::kGrpc) {
    if (options.bootstrap_port == 0) {
      control::BootstrapServerOptions bo;
      bo.host = options.bootstrap_host;
      bo.port = 0;
      auto server = control::BootstrapServer::Start(bo);
      if (!server.ok()) return server.status().WithPrefix("starting the bootstrap server");
      rep->bootstrap.port = static_cast<uint16_t>((*server)->port());
      rep->bootstrap_server = std::move(*server);
    } else {
      manager_bootstrap = true;
    }
  }

  const int32_t n = options.tp_size * options.pp_size;
  rep->group = InProcessGroup::Create(n);
  rep->comms = kernels::CreateInProcessModelComms(options.tp_size, options.pp_size);
  // Rank 0 first: with manager_bootstrap it starts the server the others register with.
  for (int32_t i = 0; i < n; ++i) {
    RankPlacement placement;
    placement.pp_rank = i / options.tp_size;
    placement.tp_rank = i % options.tp_size;
    placement.group = n > 1 ? rep->group[static_cast<size_t>(i)].get() : nullptr;
    placement.comm = n > 1 ? rep->comms[static_cast<size_t>(i)].get() : nullptr;
    placement.bootstrap = rep->bootstrap;
    placement.start_bootstrap = manager_bootstrap && i == 0;
    auto rank = HostRank::Create(options, *weights, placement);
    if (!rank.ok()) return rank.status();
    rep->state_bytes = (*rank)->state_bytes();
    rep->ranks.push_back(std::move(*rank));
  }
  rep->outputs.resize(static_cast<size_t>(n));
  rep->load = {options.role, options.tp_size, options.pp_size, 0, 0, rep->bootstrap};
  rep->barrier = std::make_unique<StepBarrier>(n + 1);
  Rep* r = rep.get();
  for (int32_t i = 0; i < n; ++i) {
    rep->rank_threads.emplace_back([r, i] { r->RankLoop(static_cast<size_t>(i)); });
  }
  rep->coordinator = std::thread([r] {
    r->CoordinatorLoop();
    r->coordinator_exit.set_value();
  });
  return std::unique_ptr<Host>(new Host(std::move(rep)));
}

Host::Host(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

Host::~Host() { Shutdown(); }

void Host::Submit(HostRequest request, RequestCallbacks callbacks) {
  {
    std::lock_guard lock(rep_->mu);
    if (!rep_->stopping) {
      rep_->intake.push_back({std::move(request), std::move(callbacks), NowUs()});
      rep_->cv.notify_all();
      return;
    }
  }
  if (callbacks.on_result) {
    callbacks.on_result(HostRequestResult::Failed(
        Status::Unavailable(std::string(RoleName(rep_->options.role)) + " host is shutting down")));
  }
}

HostLoad Host::Load() const {
  std::lock_guard lock(rep_->mu);
  return rep_->load;
}

BootstrapAddress Host::bootstrap() const { return rep_->bootstrap; }

const HostOptions& Host::options() const { return rep_->options; }

void Host::Shutdown() {
  std::call_once(rep_->shutdown_once, [this] {
    {
      std::lock_guard lock(rep_->mu);
      rep_->stopping = true;
    }
    rep_->cv.notify_all();
    // The coordinator finishes the step under way, fails what is live and lets the ranks go. A
    // rank blocked in a collective another rank left (which aborts the group when its forward
    // fails, so this is a last resort) must not hold the shutdown forever: after a grace period
    // the model's group fails every pending and later collective.
    if (rep_->coordinator_done.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      std::fprintf(stderr,
                   "pd-%s: shutdown: a step is still running after 10 s; aborting the "
                   "model's collectives\n",
                   std::string(RoleName(rep_->options.role)).c_str());
      const Status why =
          Status::Unavailable(std::string(RoleName(rep_->options.role)) + " host is shutting down");
      for (auto& comm : rep_->comms) comm->Abort(why);
    }
    rep_->coordinator.join();
    for (std::thread& t : rep_->rank_threads) t.join();
    // Each rank drops its scheduler (and so its handles) before its manager. Rank 0 last: its
    // manager may run the bootstrap server the others unregister from.
    while (!rep_->ranks.empty()) rep_->ranks.pop_back();
    rep_->bootstrap_server.reset();
  });
}

}  // namespace pdlib::hosts
