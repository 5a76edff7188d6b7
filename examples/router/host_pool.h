// HostPool: the router's view of its prefill and decode hosts (service Host in
// examples/proto/pd_serving.proto): one gRPC channel each, the load the policies see, the
// bootstrap address a prefill host reported, and whether a host is being skipped.
//
// Load: each host's `in_flight` is the router's own count of its RPCs to the host (exact and
// immediate); GetLoad's running + queued is polled every `poll_interval` and catches requests
// from other clients. The policies see the larger of the two, which does not count the router's
// own requests twice.
//
// Skipping: a host whose Generate or GetLoad failed with UNAVAILABLE is skipped by the policies
// for `unavailable_backoff`, or until a GetLoad succeeds again, whichever comes first (when every
// host of a role is skipped the policies use them all; see PickHost).
//
// Owned by the Router; outlives every request. Threads: all methods are thread-safe; a Host's
// fields say how each is guarded.
#ifndef PDLIB_EXAMPLES_ROUTER_HOST_POOL_H_
#define PDLIB_EXAMPLES_ROUTER_HOST_POOL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "examples/router/policy.h"
#include "lib/base/mutex.h"
#include "pdlib/status.h"

namespace pdlib::router {

enum class HostRole { kPrefill, kDecode };
std::string_view HostRoleName(HostRole role);  // "prefill", "decode"

// One prefill or decode host: its channel and stub, the router's counters for it, and what its
// last GetLoad said. Owned by the HostPool; every method and counter is thread-safe.
class Host {
 public:
  Host(HostRole role, std::string address);

  HostRole role() const { return role_; }
  const std::string& address() const { return address_; }
  serving::Host::Stub* stub() const { return stub_.get(); }

  // Counters. Relaxed: each is a statistic read on its own (metrics, policies); nothing else
  // is published through it.
  std::atomic<int64_t> in_flight{0};
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> failures{0};

  struct LoadInfo {
    bool answered = false;       // a GetLoad with the expected role succeeded at least once
    int64_t reported_load = 0;   // running + queued from the last GetLoad
    std::string bootstrap_host;  // prefill: from the last GetLoad
    uint32_t bootstrap_port = 0;
    int32_t dp_size = 1;
    int32_t tp_size = 1;
    std::string last_error;  // the last failed GetLoad or Generate, for progress and metrics
    std::chrono::steady_clock::time_point skip_until{};
  };
  LoadInfo load_info() const;
  bool Available(std::chrono::steady_clock::time_point now) const;
  // Records a successful GetLoad; a role mismatch is recorded as an error instead.
  void RecordLoad(const serving::LoadReply& reply);
  // Records a failed RPC; UNAVAILABLE starts skipping the host for `backoff`.
  void RecordError(const std::string& what, bool unavailable, std::chrono::milliseconds backoff);

 private:
  const HostRole role_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<serving::Host::Stub> stub_;
  mutable Mutex mu_;
  LoadInfo info_ ABSL_GUARDED_BY(mu_);
};

struct HostPoolOptions {
  std::vector<std::string> prefill;  // host:port of each prefill host's Host service
  std::vector<std::string> decode;
  std::chrono::milliseconds poll_interval{500};
  std::chrono::milliseconds rpc_timeout{1000};  // per GetLoad
  std::chrono::milliseconds unavailable_backoff{5000};
};

class HostPool {
 public:
  // Validates the addresses and creates the channels (they connect lazily).
  static StatusOr<std::unique_ptr<HostPool>> Create(const HostPoolOptions& options);
  ~HostPool();  // StopPolling()
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Polls every host until each answered GetLoad with its expected role, or `timeout` passes
  // (UNAVAILABLE naming the hosts still missing). `progress` (may be null) gets a line about
  // once a second while hosts are missing.
  Status WaitReady(std::chrono::milliseconds timeout,
                   const std::function<void(const std::string&)>& progress);
  // Starts the background GetLoad poller (first poll one interval from now).
  void StartPolling();
  void StopPolling();

  const std::vector<std::unique_ptr<Host>>& hosts(HostRole role) const {
    return role == HostRole::kPrefill ? prefill_ : decode_;
  }
  // The policies' view of `role`'s hosts, in index order.
  std::vector<HostLoad> Loads(HostRole role) const;
  const HostPoolOptions& options() const { return options_; }

  // Prometheus text: per host in-flight, requests, failures, reported load, availability.
  void AppendMetrics(std::string* out) const;

 private:
  explicit HostPool(const HostPoolOptions& options);
  // One GetLoad on every host (sequential, each bounded by rpc_timeout).
  void PollOnce();

  const HostPoolOptions options_;
  std::vector<std::unique_ptr<Host>> prefill_;
  std::vector<std::unique_ptr<Host>> decode_;

  Mutex poll_mu_;
  CondVar poll_cv_;
  bool stop_polling_ ABSL_GUARDED_BY(poll_mu_) = false;
  std::thread poller_;
};

// Checks "host:port" (port 1..65535; an IPv6 host in brackets).
Status ValidateHostPort(std::string_view address);

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_HOST_POOL_H_
