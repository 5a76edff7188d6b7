// Host: the engine of pd-prefill and pd-decode (issue #8), an in-process object so that tests
// drive it without gRPC or processes (host_service.h serves it over gRPC).
//
// A host owns tp_size x pp_size rank threads. Each rank owns its share of the example model
// (kernels/, CPU, sharded as kernels/parallel.h says: its PP stage's layers, its TP rank's heads;
// the ranks meet in the model's collectives through an in-process kernels::ModelComm group the
// host owns), a pdlib KVManager registering exactly that share (sharding.h), its metadata
// buffers, a page allocator and the reference scheduler (examples/scheduler), whose
// PollAndAllReduce runs over an InProcessGroup of all the host's ranks.
//
// Lockstep: a coordinator thread drains the intake queue once per step and hands the same list
// of requests to every rank; each rank adds them in that order, runs one scheduler Step() and
// stops at a barrier; the coordinator then reports tokens and results. Ranks never block on the
// network (pdlib's calls do not), only on the per-step barrier and the collective.
//
// Roles: "prefill", "decode", "colocated" (a decode host whose requests are prefilled on its own
// model, no pdlib: colocated.h); each with any TP and PP the model splits into. pdlib pairs a
// decode host with any prefill TP, and with a prefill PP equal to its own or decode PP 1.
//
// Thread-safety: Submit, Load and Shutdown may be called from any thread. Callbacks run on the
// coordinator thread, one at a time, and must not block or call Shutdown.
#ifndef PDLIB_EXAMPLES_HOSTS_HOST_H_
#define PDLIB_EXAMPLES_HOSTS_HOST_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/kv_manager.h"
#include "pdlib/status.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {

enum class Role : int32_t { kPrefill = 0, kDecode = 1, kColocated = 2 };
// "prefill", "decode", "colocated" (LoadReply.role).
std::string_view RoleName(Role role);

struct HostOptions {
  Role role = Role::kPrefill;
  // "small" (ModelConfig::Small), "small-hybrid", "small-mla", "small-swa" or "small-nsa"
  // (ModelConfigByName).
  std::string model = "small";
  uint64_t seed = 1;             // ModelWeights::Random seed; prefill and decode must agree
  int32_t tp_size = 1;           // tensor-parallel ranks (threads): each holds 1/tp of the heads
  int32_t pp_size = 1;           // pipeline stages: each holds its run of layers
  int32_t threads_per_rank = 0;  // model threads per rank; 0: hardware threads / ranks (>= 1)
  // Where every rank's model runs and its KV pools live (kernels::RuntimeOptions::device). kCuda:
  // the CUDA model on GPU `cuda_device`, its pools in GPU memory, registered with pdlib as
  // MemoryKind::kCuda (device_id cuda_device), so the backend must reach GPU memory ("cuda_ipc");
  // pdlib's KVManager::Create refuses a backend that cannot, naming both. Create fails with
  // "no CUDA device: <reason>" where none can be used. The CUDA model runs small and
  // small-hybrid only (no MLA, sliding-window or indexer kernels).
  kernels::Device device = kernels::Device::kCpu;
  int32_t cuda_device = 0;

  // pdlib (unused in colocated mode).
  std::string backend = "ucx";
  std::map<std::string, std::string> backend_options;
  // Which way KV moves (KVManagerOptions::direction); prefill and decode hosts must agree. In
  // pull the prefill scheduler publishes every page of the prompt as soon as it is computed,
  // without waiting for decode's TransferInfo (PrefillSchedulerOptions::direction).
  TransferDirection direction = TransferDirection::kPush;
  ControlPlane control_plane = ControlPlane::kGrpc;  // tests use kInProcess
  std::string listen_host = "127.0.0.1";             // prefill ranks' control endpoints
  // Prefill: the bootstrap server its ranks register with. start_bootstrap runs it in this
  // process: in rank 0's KVManager for a fixed port; with port 0 the host starts pdlib's
  // bootstrap server itself (a manager cannot report the port it picked) and bootstrap() tells.
  std::string bootstrap_host = "127.0.0.1";
  uint16_t bootstrap_port = 8998;
  bool start_bootstrap = false;
  std::chrono::milliseconds bootstrap_timeout{10000};
  std::chrono::milliseconds waiting_timeout{60000};
  std::chrono::milliseconds transfer_timeout{30000};
  std::chrono::milliseconds liveness_timeout{5000};
  std::chrono::milliseconds connect_timeout{5000};
  // How prefill ranks are found (KVManagerOptions::discovery): the bootstrap server, or etcd
  // (then bootstrap_host:bootstrap_port only names the prefill deployment; nothing runs there).
  Discovery discovery = Discovery::kBootstrapServer;
  std::vector<std::string> etcd_endpoints;  // "host:port" each
  std::string etcd_prefix = "/pdlib";
  // Decode: prefill deployments ("host:port" of their bootstrap servers) to connect to at start
  // (KVManager::Connect), so that their first requests pay no connection set-up.
  std::vector<std::string> connect;

  // Scheduler.
  int32_t num_pages = 512;  // KV pages per rank (page_size tokens each)
  int32_t max_running = 16;
  int32_t chunked_prefill_size = 512;  // prefill and colocated prefill token budget
  int32_t max_context_len = 4096;
  int32_t reserved_decode_tokens = 64;  // decode
  // Decode: decode prefix reuse (DecodeSchedulerOptions::prefix_cache_pages): finished requests'
  // full KV pages stay cached, up to this many, and a prompt that starts with them is received
  // only from where they end. 0: off. Not with --colocated, nor with models that carry
  // per-request state.
  int32_t prefix_cache_pages = 0;
  // Prefill: layer-wise streaming (PrefillSchedulerOptions::layerwise): each chunk's KV layers
  // are handed to pdlib as the model finishes them, so the transfer overlaps the forward.
  bool layerwise = true;
  // How long the loop sleeps after a step that ran no forward pass (waiting on the network).
  std::chrono::microseconds idle_poll{500};

  // TEST ONLY, decode: "swap-heads" makes decode rank tp 0 pp 0 corrupt every request's KV once
  // it has arrived, before the first decode step (sharding.h, CorruptReceivedPage), so that a
  // test shows its token comparison cannot pass vacuously. "": none.
  std::string test_fault;
};

// Checks a HostOptions on its own: sizes, the model name, the model split (TP and PP against the
// model's heads and layers), the test fault.
Status ValidateHostOptions(const HostOptions& options);

// One request, as HostGenerateRequest carries it.
struct HostRequest {
  uint64_t room = 0;
  std::vector<int32_t> prompt;
  int32_t max_new_tokens = 16;
  BootstrapAddress bootstrap;  // decode: the request's prefill deployment
  std::optional<int32_t> prefill_dp_rank;
};

// What HostResult carries. Times are microseconds since the host received the request; 0 when
// the request never got there.
struct HostRequestResult {
  Status status;
  std::vector<int32_t> output_ids;  // prefill: the first token; decode: every generated token
  int64_t first_token_us = 0;
  int64_t transfer_us = 0;  // prefill: first chunk sent until the transfer ended; decode:
                            // receiver Init until the KV arrived
  int64_t finish_us = 0;
  uint64_t kv_bytes = 0;  // KV and state bytes moved (0 in colocated mode)
  // Prefill: the transfer time left after the request's last forward pass (its end to the
  // transfer's Success, the slowest rank's); what layer-wise streaming hides is the rest.
  int64_t exposed_transfer_us = 0;

  static HostRequestResult Failed(Status why) {
    HostRequestResult r;
    r.status = std::move(why);
    return r;
  }
};

struct RequestCallbacks {
  // Decode and colocated: each generated token as it is produced (index 0 first). May be null.
  std::function<void(int32_t index, int32_t token)> on_token;
  // Called exactly once, last.
  std::function<void(HostRequestResult result)> on_result;
};

struct HostLoad {
  Role role = Role::kPrefill;
  int32_t tp_size = 1;
  int32_t pp_size = 1;
  int32_t running = 0;         // requests holding KV pages
  int32_t queued = 0;          // accepted, not yet holding pages
  BootstrapAddress bootstrap;  // prefill
};

class Host {
 public:
  // Builds every rank (models, pools, managers, schedulers) and starts the threads. Errors name
  // the rank and the step that failed.
  static StatusOr<std::unique_ptr<Host>> Create(const HostOptions& options);
  ~Host();  // Shutdown()
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;

  // Queues a request for the next step. callbacks.on_result is always called, also when the
  // request is refused (invalid, duplicate room, host shut down: then from this call).
  void Submit(HostRequest request, RequestCallbacks callbacks);

  HostLoad Load() const;
  // Prefill: where decode hosts find this host's ranks.
  BootstrapAddress bootstrap() const;
  const HostOptions& options() const;

  // Fails every live request with a reason (pdlib tells the peers), stops the threads, then
  // destroys handles before managers. Idempotent.
  void Shutdown();

 private:
  struct Rep;
  explicit Host(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_HOST_H_
