// Deployment: the example's processes on 127.0.0.1 — a pdlib-bootstrap and a pd-prefill per
// prefill host (or one etcd for all), pd-decode hosts, optionally a colocated pd-decode, and
// pd-router in front — and a client for them; or each in a network namespace of its own
// (netns). pd-demo runs one; the end-to-end tests run several topologies.
//
// Ownership: a Deployment owns its child processes; destroying it stops them (SIGTERM, then
// SIGKILL after a grace period). Threads: Generate/GenerateColocated may be called from many
// threads at once; Start, KillPrefill and the destructor from one.
#ifndef PDLIB_EXAMPLES_DEMO_DEPLOYMENT_H_
#define PDLIB_EXAMPLES_DEMO_DEPLOYMENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::demo {

struct PrefillSpec {
  int32_t tp = 1;
  int32_t pp = 1;
};

struct DeploymentOptions {
  // The example binaries; the defaults are those of this build tree.
  std::string prefill_bin, decode_bin, router_bin, bootstrap_bin;
  std::vector<PrefillSpec> prefills = {PrefillSpec{}};
  int32_t decodes = 1;
  int32_t decode_tp = 1;  // TP ranks per decode host (pd-decode --tp)
  int32_t decode_pp = 1;  // PP stages per decode host: 1 or the prefill hosts' PP (pdlib's rule)
  bool colocated = true;  // also start a colocated host (pd-decode --colocated, TP 1 PP 1)
  // small | small-hybrid | small-mla | small-swa | small-nsa (the hosts' --model).
  std::string model = "small";
  // TEST ONLY: passed to every decode host as --test-fault (e.g. "swap-heads": outputs must
  // differ); "" for none.
  std::string decode_test_fault;
  // Prefill hosts' layer-wise streaming (pd-prefill --layerwise).
  bool layerwise = true;
  // Which way pdlib moves KV on the prefill and decode hosts (their --direction): "push" or
  // "pull" (decode reads prefill's published pages).
  std::string direction = "push";
  // Decode hosts' prefix cache (pd-decode --prefix-cache-pages): decode prefix reuse. 0: off.
  int32_t prefix_cache_pages = 0;
  uint64_t seed = 1;  // model weights; every host uses the same
  // The prefill and decode hosts' device (their --device: "cpu" or "cuda", KV pools in GPU
  // memory) and GPU (--cuda-device), and the colocated host's device: the reference the
  // disaggregated outputs are compared with.
  std::string device = "cpu";
  int32_t cuda_device = 0;
  std::string colocated_device = "cpu";
  std::string backend = "ucx";
  std::vector<std::string> backend_options;  // "key=value", passed to every host
  std::string policy = "power-of-two";
  int32_t num_pages = 512;  // KV pages per host
  std::string log_dir;      // each process's stderr goes to <log_dir>/<name>.log
  // How prefill ranks are found: "bootstrap" (a pdlib-bootstrap per prefill host) or "etcd"
  // (one etcd member, `etcd_bin`, that every host registers in and resolves from).
  std::string discovery = "bootstrap";
  std::string etcd_bin = "etcd";
  // Hosts as network namespaces (pd-demo --netns, tools/netns): every process in a namespace
  // of its own on one bridge, with its own address; the hosts' backend options get
  // ucx.tls=tcp and ucx.net_devices=eth0 (no shared memory between "hosts"). Needs root.
  bool netns = false;
  // With netns: a bandwidth cap (Mbit/s, tc tbf) on every host's link; 0 none.
  int32_t link_mbit = 0;
  int32_t start_timeout_ms = 60000;
  int32_t request_timeout_ms = 60000;
};

// One request's result as the client saw it.
struct Outcome {
  bool ok = false;
  std::string reason;  // why it failed
  std::vector<int32_t> output_ids;
  int64_t ttft_us = 0;              // client: sent until the first token arrived
  int64_t latency_us = 0;           // client: sent until the stream ended
  int64_t transfer_us = 0;          // router's GenerateResult (decode host's measure)
  int64_t exposed_transfer_us = 0;  // router's GenerateResult (prefill host's measure)
  uint64_t kv_bytes = 0;
  uint64_t room = 0;
  std::string prefill_host, decode_host;
};

class Deployment {
 public:
  static StatusOr<std::unique_ptr<Deployment>> Start(const DeploymentOptions& options);
  ~Deployment();
  Deployment(const Deployment&) = delete;
  Deployment& operator=(const Deployment&) = delete;

  // Through pd-router (disaggregated).
  Outcome Generate(const std::vector<int32_t>& prompt, int32_t max_new_tokens);
  // Straight to the colocated host (requires options.colocated).
  Outcome GenerateColocated(const std::vector<int32_t>& prompt, int32_t max_new_tokens);

  // With netns: the address of the bridge's side (where this process talks to the hosts) and
  // a host's address by its name ("prefill0", "decode0", "router", "etcd", ...); "" otherwise.
  std::string host_ip(const std::string& name) const;
  // SIGKILLs prefill host `index` (its bootstrap server stays up).
  void KillPrefill(size_t index);
  std::string router_address() const;
  // host:port of prefill host `index`'s gRPC service (as GenerateResult::prefill_host names it).
  std::string prefill_address(size_t index) const;
  int http_port() const;
  // The tail of every process's log, for failure reports.
  std::string LogTails(size_t max_bytes_each = 2000) const;

 private:
  struct Impl;
  explicit Deployment(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdlib::demo

#endif  // PDLIB_EXAMPLES_DEMO_DEPLOYMENT_H_
