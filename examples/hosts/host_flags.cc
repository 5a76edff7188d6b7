#include "examples/hosts/host_flags.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "tools/common/flags.h"

// pd-prefill and pd-decode share these definitions (one binary each, one host library); the flags
// of one role only are refused by the other (kPrefillOnly, kDecodeOnly below). Defaults come from
// HostOptions, so that the command line and the in-process API agree.
ABSL_FLAG(std::string, host, pdlib::hosts::HostOptions{}.listen_host,
          "address for gRPC (pd-prefill: and the ranks' pdlib control endpoints)");
ABSL_FLAG(int32_t, port, 0, "gRPC port; 0 picks a free one");
ABSL_FLAG(std::string, model, pdlib::hosts::HostOptions{}.model,
          "small | small-hybrid (recurrent layers 1 and 3: mamba state) | small-mla (multi-head "
          "latent attention: one latent row per token, is_mla) | small-swa (layers 1 and 3 "
          "attend to a sliding window of 24: SWA state) | small-nsa (a lightning indexer picks "
          "the 24 positions each token attends to: NSA state, the index keys of every page)");
ABSL_FLAG(uint64_t, seed, pdlib::hosts::HostOptions{}.seed,
          "random-weights seed; prefill and decode must agree");
ABSL_FLAG(int32_t, tp, 1,
          "tensor-parallel ranks (threads): each holds and computes 1/N of the query heads and the "
          "KV heads they read (replicated when N exceeds the KV heads; MLA's latent on every "
          "rank) and registers only those with pdlib, which pairs any prefill TP with any "
          "decode TP");
ABSL_FLAG(int32_t, pp, 1,
          "pipeline stages: stage s holds layers [s*L/N, (s+1)*L/N) and registers only their KV "
          "and state. pd-decode: equal to the prefill's PP, or 1 (pdlib's rule)");
ABSL_FLAG(int32_t, threads, pdlib::hosts::HostOptions{}.threads_per_rank,
          "model threads per rank; 0: hardware threads / ranks");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda: where every rank's model runs and its KV pools live. cuda: the CUDA model "
          "on GPU --cuda-device, KV pools in GPU memory registered with pdlib as kCuda (the "
          "backend must reach GPU memory; --backend then defaults to cuda_ipc); models small and "
          "small-hybrid only; exits 1 with 'no CUDA device: <reason>' where no GPU can be used");
ABSL_FLAG(int32_t, cuda_device, pdlib::hosts::HostOptions{}.cuda_device,
          "with --device cuda: which CUDA device every rank uses");
ABSL_FLAG(bool, colocated, false,
          "pd-decode: prefill on this host's own model, no pdlib (role colocated); requests' "
          "bootstrap fields are ignored");
ABSL_FLAG(std::string, backend, pdlib::hosts::HostOptions{}.backend,
          "pdlib transport: ucx | fake | verbs | cuda_ipc (GPU memory on one node; the default "
          "with --device cuda). fake moves no bytes: requests complete, tokens are wrong "
          "(control-plane tests)");
ABSL_FLAG(std::string, direction, "push",
          "which way pdlib moves KV (KVManagerOptions::direction; pd-prefill and pd-decode of a "
          "deployment must agree, a decode that differs is refused naming both): push (prefill "
          "writes into decode's pages once decode's request arrives) | pull (prefill publishes "
          "each chunk's pages as soon as it is computed, before decode's request if need be, "
          "and holds them until every decode rank has read them; with a decode prefix prefill "
          "publishes every page of the prompt and decode reads only those after its prefix). "
          "pull needs a backend that can read (a host whose backend cannot exits 1, naming "
          "it); ignored with --colocated");
ABSL_FLAG(pdlib_tools::Repeated, backend_option, {},
          "KEY=VALUE backend setting, repeatable (e.g. ucx.tls=shm, ucx.net_devices=lo)");
ABSL_FLAG(std::string, bootstrap_host, pdlib::hosts::HostOptions{}.bootstrap_host,
          "pd-prefill: bootstrap server the ranks register with");
ABSL_FLAG(int32_t, bootstrap_port, pdlib::hosts::HostOptions{}.bootstrap_port,
          "pd-prefill: its port; with --start_bootstrap, 0 picks a free one");
ABSL_FLAG(bool, start_bootstrap, false,
          "pd-prefill: run pdlib's bootstrap server in this process (in rank 0's manager; for port "
          "0 the host runs it); otherwise a pdlib-bootstrap must run");
ABSL_FLAG(std::string, discovery, "bootstrap",
          "how prefill ranks are found: 'bootstrap' (a bootstrap server at --bootstrap-host/port) "
          "or 'etcd' (--etcd-endpoints; pd-prefill's --bootstrap-host/port then only name its "
          "deployment, the address decode is given in each request)");
ABSL_FLAG(std::vector<std::string>, etcd_endpoints, {},
          "with --discovery etcd: HOST:PORT of the etcd members (repeatable or comma-separated)");
ABSL_FLAG(std::string, etcd_prefix, pdlib::hosts::HostOptions{}.etcd_prefix,
          "with --discovery etcd: the key prefix every rank registers under");
ABSL_FLAG(int32_t, num_pages, pdlib::hosts::HostOptions{}.num_pages,
          "KV pages per rank, 16 tokens each");
ABSL_FLAG(int32_t, max_running, pdlib::hosts::HostOptions{}.max_running,
          "requests holding KV at once (pd-decode: as many more may be pre-allocated)");
ABSL_FLAG(int32_t, chunked_prefill_size, pdlib::hosts::HostOptions{}.chunked_prefill_size,
          "token budget of one prefill forward");
ABSL_FLAG(int32_t, max_context_len, pdlib::hosts::HostOptions{}.max_context_len,
          "longest prompt (pd-decode: prompt + max_new_tokens) accepted");
ABSL_FLAG(int32_t, prefix_cache_pages, pdlib::hosts::HostOptions{}.prefix_cache_pages,
          "pd-decode: decode prefix reuse: keep up to N of finished requests' full KV pages; a "
          "new prompt that starts with cached pages borrows them and prefill sends only the "
          "pages after them (KVReceiver::Init with decode_prefix_len). 0: off. Models without "
          "per-request state only (small, small-mla), not with --colocated");
ABSL_FLAG(int32_t, reserved_decode_tokens, pdlib::hosts::HostOptions{}.reserved_decode_tokens,
          "pd-decode: tokens kept free per admitted request");
ABSL_FLAG(int32_t, bootstrap_timeout_ms,
          int32_t(pdlib::hosts::HostOptions{}.bootstrap_timeout.count()),
          "a request not bootstrapped within N ms fails");
ABSL_FLAG(int32_t, waiting_timeout_ms, int32_t(pdlib::hosts::HostOptions{}.waiting_timeout.count()),
          "a request waiting for its KV to be sent fails after N ms");
ABSL_FLAG(int32_t, transfer_timeout_ms,
          int32_t(pdlib::hosts::HostOptions{}.transfer_timeout.count()),
          "a transfer not done within N ms fails");
ABSL_FLAG(int32_t, liveness_timeout_ms,
          int32_t(pdlib::hosts::HostOptions{}.liveness_timeout.count()),
          "a silent peer is declared dead after N ms, >= 1000");
ABSL_FLAG(int32_t, connect_timeout_ms, int32_t(pdlib::hosts::HostOptions{}.connect_timeout.count()),
          "connection set-up gives up after N ms");
ABSL_FLAG(std::vector<std::string>, connect, {},
          "pd-decode: HOST:PORT of a prefill deployment's bootstrap server to connect to before "
          "the first request (warm-up; repeatable or comma-separated; a failure is logged)");
ABSL_FLAG(int32_t, idle_poll_us, int32_t(pdlib::hosts::HostOptions{}.idle_poll.count()),
          "sleep between steps that only wait on the network");
ABSL_FLAG(bool, layerwise, pdlib::hosts::HostOptions{}.layerwise,
          "pd-prefill: layer-wise streaming: hand each chunk's KV layers to pdlib as the model "
          "finishes them (KVSender::SendLayers), so the transfer overlaps the forward pass; "
          "--nolayerwise sends each chunk after its forward");
ABSL_FLAG(bool, verbose, false, "pdlib info logs on stderr");
ABSL_FLAG(std::string, test_fault, "",
          "pd-decode, TEST ONLY: 'swap-heads' makes decode rank tp 0 pp 0 corrupt every "
          "request's KV once it has arrived (swaps two KV heads, or the keys of neighbouring "
          "tokens when the rank holds one head or MLA latents), so that a test shows its token "
          "comparison can fail; 'swap-index' swaps the index keys of neighbouring tokens in every "
          "received index page of an NSA model (small-nsa) and leaves the KV intact. Outputs "
          "are wrong by design");

namespace pdlib::hosts {
namespace {

constexpr std::string_view kPrefillOnly[] = {"bootstrap_host", "bootstrap_port", "start_bootstrap"};
constexpr std::string_view kDecodeOnly[] = {"colocated", "reserved_decode_tokens", "connect",
                                            "prefix_cache_pages", "test_fault"};
constexpr char kCudaDefaultBackend[] = "cuda_ipc";
// pd-prefill only, beyond kPrefillOnly's bootstrap flags (decode rejects them the same way).
constexpr std::string_view kPrefillPolicy[] = {"layerwise"};

bool Contains(std::span<const std::string_view> names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Whether `program` takes flag `name`.
bool Takes(Role program, std::string_view name) {
  return program == Role::kPrefill
             ? !Contains(kDecodeOnly, name)
             : !Contains(kPrefillOnly, name) && !Contains(kPrefillPolicy, name);
}

// The value of int flag `name`, checked to lie in [min, max].
Status InRange(std::string_view name, int64_t value, int64_t min, int64_t max) {
  if (value >= min && value <= max) return Status::OK();
  return Status::InvalidArgument("--" + std::string(name) + " '" + std::to_string(value) +
                                 "': not an integer in [" + std::to_string(min) + ", " +
                                 std::to_string(max) + "]");
}

}  // namespace

std::string HostUsage(Role program) {
  const bool prefill = program == Role::kPrefill;
  std::string u = prefill ? "usage: pd-prefill [flags]\n\n"
                            "Serves the prefill side of the example deployment (issue #8): runs "
                            "each request's\nprompt on the example model and sends its KV with "
                            "pdlib to the decode host that asks.\n"
                          : "usage: pd-decode [flags]\n\n"
                            "Serves the decode side of the example deployment (issue #8): receives "
                            "each request's KV\nfrom its prefill host with pdlib and generates its "
                            "tokens. With --colocated, prefills\nrequests itself instead (no "
                            "transfer): the baseline a disaggregated run is compared to.\n";
  u +=
      "\nServes gRPC service Host (examples/proto/pd_serving.proto). Once serving, prints one line "
      "on\nstdout: READY role=<role> port=<grpc port>";
  u += prefill ? " bootstrap=<host>:<port>\n" : "\n";
  u += "then serves until SIGINT or SIGTERM (in-flight requests fail with a reason). "
       "Diagnostics go\nto stderr. Exit status: 0 clean, 1 failure to start, 2 bad command line.\n";
  return pdlib_tools::FlagsHelpFor(
      u, [program](std::string_view name) { return Takes(program, name); });
}

StatusOr<HostFlags> ParseHostFlags(Role program, std::span<const std::string_view> args) {
  const bool prefill = program == Role::kPrefill;
  const pdlib_tools::FlagParse parsed =
      pdlib_tools::TryParseFlags(std::vector<std::string>(args.begin(), args.end()),
                                 {"connect", "etcd_endpoints"}, {"backend_option"});
  HostFlags f;
  if (parsed.help) {
    f.help = true;
    return f;
  }
  if (!parsed.error.empty()) return Status::InvalidArgument(parsed.error);
  if (!parsed.positional.empty()) {
    return Status::InvalidArgument("unexpected argument '" + parsed.positional[0] +
                                   "' (see --help)");
  }
  for (const std::string& name : parsed.given) {
    if (Takes(program, name)) continue;
    if (!prefill && (name == "bootstrap_host" || name == "bootstrap_port")) {
      return Status::InvalidArgument("--" + name +
                                     ": decode takes the prefill bootstrap address from each "
                                     "request (HostGenerateRequest.bootstrap_host/port)");
    }
    return Status::InvalidArgument("--" + name + ": not a flag of " +
                                   (prefill ? "pd-prefill" : "pd-decode") + " (see --help)");
  }

  HostOptions& o = f.host;
  o.role = program;
  f.verbose = absl::GetFlag(FLAGS_verbose);
  f.grpc_host = o.listen_host = absl::GetFlag(FLAGS_host);
  if (f.grpc_host.empty()) return Status::InvalidArgument("--host: empty");
  f.grpc_port = absl::GetFlag(FLAGS_port);
  o.model = absl::GetFlag(FLAGS_model);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.threads_per_rank = absl::GetFlag(FLAGS_threads);
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cuda") {
    o.device = kernels::Device::kCuda;
  } else if (device != "cpu") {
    return Status::InvalidArgument("--device '" + device + "': expected cpu or cuda");
  }
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  o.backend = absl::GetFlag(FLAGS_backend);
  // GPU pools need a backend that reaches GPU memory: cuda_ipc unless one is named.
  if (o.device == kernels::Device::kCuda &&
      std::find(parsed.given.begin(), parsed.given.end(), "backend") == parsed.given.end()) {
    o.backend = kCudaDefaultBackend;
  }
  const std::string direction = absl::GetFlag(FLAGS_direction);
  if (direction == "pull") {
    o.direction = TransferDirection::kPull;
  } else if (direction != "push") {
    return Status::InvalidArgument("--direction '" + direction + "': expected push or pull");
  }
  for (const std::string& kv : absl::GetFlag(FLAGS_backend_option).values) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status::InvalidArgument("--backend_option '" + kv + "': expected KEY=VALUE");
    }
    o.backend_options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  o.bootstrap_host = absl::GetFlag(FLAGS_bootstrap_host);
  if (o.bootstrap_host.empty()) return Status::InvalidArgument("--bootstrap_host: empty");
  o.start_bootstrap = absl::GetFlag(FLAGS_start_bootstrap);
  o.num_pages = absl::GetFlag(FLAGS_num_pages);
  o.max_running = absl::GetFlag(FLAGS_max_running);
  o.chunked_prefill_size = absl::GetFlag(FLAGS_chunked_prefill_size);
  o.max_context_len = absl::GetFlag(FLAGS_max_context_len);
  o.reserved_decode_tokens = absl::GetFlag(FLAGS_reserved_decode_tokens);
  o.prefix_cache_pages = absl::GetFlag(FLAGS_prefix_cache_pages);
  o.bootstrap_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_bootstrap_timeout_ms));
  o.waiting_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_waiting_timeout_ms));
  o.transfer_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_transfer_timeout_ms));
  o.liveness_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_liveness_timeout_ms));
  o.connect_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_connect_timeout_ms));
  o.idle_poll = std::chrono::microseconds(absl::GetFlag(FLAGS_idle_poll_us));
  o.layerwise = absl::GetFlag(FLAGS_layerwise);
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const int32_t tp = absl::GetFlag(FLAGS_tp), pp = absl::GetFlag(FLAGS_pp);
  const int32_t bootstrap_port = absl::GetFlag(FLAGS_bootstrap_port);
  for (const Status& s : {
           InRange("port", f.grpc_port, 0, 65535),
           InRange("tp", tp, 1, 64),
           InRange("pp", pp, 1, 64),
           InRange("threads", o.threads_per_rank, 0, 1024),
           InRange("cuda_device", o.cuda_device, 0, 1023),
           InRange("bootstrap_port", bootstrap_port, 0, 65535),
           InRange("num_pages", o.num_pages, 1, kMax),
           InRange("max_running", o.max_running, 1, 1 << 16),
           InRange("chunked_prefill_size", o.chunked_prefill_size, 1, kMax),
           InRange("max_context_len", o.max_context_len, 1, kMax),
           InRange("reserved_decode_tokens", o.reserved_decode_tokens, 0, kMax),
           InRange("prefix_cache_pages", o.prefix_cache_pages, 0, kMax),
           InRange("bootstrap_timeout_ms", o.bootstrap_timeout.count(), 1, kMax),
           InRange("waiting_timeout_ms", o.waiting_timeout.count(), 1, kMax),
           InRange("transfer_timeout_ms", o.transfer_timeout.count(), 1, kMax),
           InRange("liveness_timeout_ms", o.liveness_timeout.count(), 1000, kMax),
           InRange("connect_timeout_ms", o.connect_timeout.count(), 1, kMax),
           InRange("idle_poll_us", o.idle_poll.count(), 0, 1000000),
       }) {
    if (!s.ok()) return s;
  }
  o.bootstrap_port = static_cast<uint16_t>(bootstrap_port);
  for (const std::string& address : absl::GetFlag(FLAGS_connect)) {
    const size_t colon = address.rfind(':');
    int32_t port = 0;
    const char* end = address.data() + address.size();
    bool ok = colon != std::string::npos && colon != 0;
    if (ok) {
      const auto [at, ec] = std::from_chars(address.data() + colon + 1, end, port);
      ok = ec == std::errc() && at == end && port >= 1 && port <= 65535;
    }
    if (!ok) {
      return Status::InvalidArgument("--connect wants HOST:PORT, got '" + address + "'");
    }
    o.connect.push_back(address);
  }
  const std::string discovery = absl::GetFlag(FLAGS_discovery);
  if (discovery == "etcd") {
    o.discovery = Discovery::kEtcd;
  } else if (discovery != "bootstrap") {
    return Status::InvalidArgument("--discovery '" + discovery + "': expected bootstrap or etcd");
  }
  o.etcd_endpoints = absl::GetFlag(FLAGS_etcd_endpoints);
  o.etcd_prefix = absl::GetFlag(FLAGS_etcd_prefix);
  if (o.discovery == Discovery::kEtcd && o.etcd_endpoints.empty()) {
    return Status::InvalidArgument("--discovery etcd needs --etcd-endpoints HOST:PORT");
  }
  if (o.discovery != Discovery::kEtcd && !o.etcd_endpoints.empty()) {
    return Status::InvalidArgument("--etcd-endpoints needs --discovery etcd");
  }
  if (absl::GetFlag(FLAGS_colocated)) o.role = Role::kColocated;
  o.test_fault = absl::GetFlag(FLAGS_test_fault);
  o.tp_size = tp;
  o.pp_size = pp;
  if (Status s = ValidateHostOptions(o); !s.ok()) return s;
  return f;
}

}  // namespace pdlib::hosts
