// RouterCore: runs requests. For each it picks a prefill and a decode host (policy.h), draws a
// bootstrap room, sends the same HostGenerateRequest to both hosts at once (decode's carries the
// prefill host's bootstrap address), passes decode's tokens to the request's observer as they
// arrive, and ends with one RequestResult.
//
// Failures: a request fails when either host's RPC fails, ends without a result, or sends a
// result that is not ok; the reason names the failing host and its reason (prefill first, since
// a prefill failure makes decode fail too). When one host fails, the other gets `settle_time` to
// end by itself (its own reason is then reported as well) and is cancelled after that. Decode's
// ok result makes the request a success (pdlib finishes decode only after prefill reported the
// transfer done); prefill then gets `settle_time` to send its result. Every RPC carries the
// deadline `request_timeout`, so a host that never answers cannot hold a request longer. A host
// that dies fails only the requests on it; UNAVAILABLE errors make the policies skip it for a
// while (host_pool.h).
//
// Ownership: the Router owns the core and the HostPool, which must outlive the core. Stop() (also
// run by the destructor) cancels every request and waits until all have ended, so that nothing
// refers to either afterwards.
// Threads: all methods are thread-safe. Observers are called on gRPC threads.
#ifndef PDLIB_EXAMPLES_ROUTER_CORE_H_
#define PDLIB_EXAMPLES_ROUTER_CORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "examples/router/host_pool.h"
#include "examples/router/policy.h"
#include "examples/router/request.h"
#include "lib/base/mutex.h"
#include "pdlib/status.h"

namespace pdlib::router {

// Receives one request's tokens, then its result. Called on gRPC threads, one call at a time
// per request, in order; must not block (queue and return).
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  // The next token sent to the client; `index` counts from 0 without gaps.
  virtual void OnToken(int32_t token_id, int32_t index) = 0;
  // Exactly once, after every OnToken. May come on the thread that called Submit.
  virtual void OnResult(const RequestResult& result) = 0;
};

class RequestCall;

// Lets a front end cancel its request (client gone). Copyable; does not keep the request alive.
class RequestHandle {
 public:
  RequestHandle() = default;
  // Cancels both host RPCs; the result's status is `why`. No-op once the request has ended.
  void Cancel(const Status& why) const;
  uint64_t room() const { return room_; }

 private:
  friend class RouterCore;
  RequestHandle(std::weak_ptr<RequestCall> call, uint64_t room)
      : call_(std::move(call)), room_(room) {}
  std::weak_ptr<RequestCall> call_;
  uint64_t room_ = 0;
};

struct RouterCoreOptions {
  Policy policy = Policy::kPowerOfTwo;
  uint64_t seed = 0;  // policies' random choices and the first room
  std::chrono::milliseconds request_timeout{60000};
  std::chrono::milliseconds settle_time{500};  // see the file comment
};

class RouterCore {
 public:
  RouterCore(HostPool* pool, const RouterCoreOptions& options);
  ~RouterCore();  // Stop()
  RouterCore(const RouterCore&) = delete;
  RouterCore& operator=(const RouterCore&) = delete;

  // Dispatches `request`; `observer` then gets its tokens and result. Fails (and the observer is
  // never called) only when the router is stopping.
  StatusOr<RequestHandle> Submit(RouterRequest request, std::shared_ptr<RequestObserver> observer);

  // Refuses new requests and cancels those in flight (their status: UNAVAILABLE `why`).
  void BeginStop(const std::string& why);
  // BeginStop, then waits until every request has ended. Idempotent.
  void Stop();

  // Prometheus text: request counters, in flight, and the pool's per-host metrics.
  void AppendMetrics(std::string* out) const;

 private:
  friend class RequestCall;
  void CallStarted();
  void CallEnded(uint64_t room);

  HostPool* const pool_;
  const RouterCoreOptions options_;
  struct Timers;
  std::unique_ptr<Timers> timers_;  // delayed cancellations (settle_time)

  Mutex pick_mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(pick_mu_);
  RoomGenerator rooms_ ABSL_GUARDED_BY(pick_mu_);

  mutable Mutex live_mu_;
  CondVar live_cv_;
  bool stopping_ ABSL_GUARDED_BY(live_mu_) = false;
  int64_t live_count_ ABSL_GUARDED_BY(live_mu_) = 0;  // RequestCall objects alive
  std::map<uint64_t, std::weak_ptr<RequestCall>> live_ ABSL_GUARDED_BY(live_mu_);  // by room

  // Relaxed: statistics, each read on its own.
  std::atomic<uint64_t> requests_total_{0};
  std::atomic<uint64_t> requests_failed_{0};
};

}  // namespace pdlib::router

#endif  // PDLIB_EXAMPLES_ROUTER_CORE_H_
