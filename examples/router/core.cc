#include "examples/router/core.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <array>
#include <functional>
#include <thread>
#include <vector>

#include "lib/base/tsan.h"
#include "lib/control/grpc_runtime.h"
#include "lib/control/grpc_status.h"

namespace pdlib::router {

using Clock = std::chrono::steady_clock;

namespace {

enum Side { kPrefillSide = 0, kDecodeSide = 1 };

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

std::string CodeName(StatusCode code) { return std::string(StatusCodeName(code)); }

}  // namespace

// Runs delayed actions on one thread (the settle-time cancellations).
struct RouterCore::Timers {
  Timers() : thread([this] { Run(); }) {}
  ~Timers() { Stop(); }

  void Add(Clock::time_point when, std::function<void()> fn) {
    {
      MutexLock lock(&mu);
      if (stopped) return;
      queue.emplace(when, std::move(fn));
    }
    cv.Signal();
  }

  void Stop() {
    {
      MutexLock lock(&mu);
      stopped = true;
      queue.clear();
    }
    cv.Signal();
    if (thread.joinable()) thread.join();
  }

  void Run() {
    while (true) {
      std::function<void()> fn;
      {
        MutexLock lock(&mu);
        while (!fn) {
          if (stopped) return;
          if (queue.empty()) {
            cv.Wait(&mu);
            continue;
          }
          const auto now = Clock::now();
          if (queue.begin()->first > now) {
            cv.WaitFor(&mu, queue.begin()->first - now);
            continue;
          }
          fn = std::move(queue.begin()->second);
          queue.erase(queue.begin());
        }
      }
      fn();
    }
  }

  Mutex mu;
  CondVar cv;
  bool stopped ABSL_GUARDED_BY(mu) = false;
  std::multimap<Clock::time_point, std::function<void()>> queue ABSL_GUARDED_BY(mu);
  std::thread thread;
};

// One request: two server-streaming Host.Generate RPCs (callback API) and what they returned.
// Kept alive by each RPC's reactor until its OnDone, and briefly by handles and timers (weak).
class RequestCall : public std::enable_shared_from_this<RequestCall> {
 public:
  RequestCall(RouterCore* core, uint64_t room, Host* prefill, Host* decode, RouterRequest request,
              std::shared_ptr<RequestObserver> observer, Clock::time_point received)
      : core_(core),
        room_(room),
        request_(std::move(request)),
        observer_(std::move(observer)),
        received_(received) {
    sides_[kPrefillSide] = std::make_unique<SideState>(this, kPrefillSide, prefill);
    sides_[kDecodeSide] = std::make_unique<SideState>(this, kDecodeSide, decode);
    core_->CallStarted();
  }

  ~RequestCall() {
    // The RPC state goes first, so that CallEnded is the last touch of anything gRPC or the
    // core owns: Stop() may return, and the pool be destroyed, right after it.
    sides_[kPrefillSide].reset();
    sides_[kDecodeSide].reset();
    observer_.reset();
    core_->CallEnded(room_);
  }

  void Start(const Host::LoadInfo& prefill_info) {
    const auto deadline = std::chrono::system_clock::now() + core_->options_.request_timeout;
    for (auto& side : sides_) {
      serving::HostGenerateRequest& r = side->request;
      r.set_room(room_);
      r.mutable_prompt_ids()->Add(request_.prompt_ids.begin(), request_.prompt_ids.end());
      r.set_max_new_tokens(request_.max_new_tokens);
      side->ctx.set_deadline(deadline);
    }
    serving::HostGenerateRequest& d = sides_[kDecodeSide]->request;
    d.set_bootstrap_host(prefill_info.bootstrap_host);
    d.set_bootstrap_port(prefill_info.bootstrap_port);
    d.set_prefill_dp_rank(-1);  // room % the prefill deployment's DP size
    std::shared_ptr<RequestCall> self = shared_from_this();
    for (auto& side : sides_) {
      side->host->stub()->async()->Generate(&side->ctx, &side->request, &side->stream);
      side->stream.Begin(self);
    }
  }

  // Cancels both RPCs; the result's status is `why` unless a host failed first.
  void Cancel(const Status& why) {
    {
      MutexLock lock(&mu_);
      if (finished_) return;
      if (cancel_status_.ok()) cancel_status_ = why;
    }
    for (auto& side : sides_) side->ctx.TryCancel();
  }

 private:
  class Stream final : public grpc::ClientReadReactor<serving::HostEvent> {
   public:
    Stream(RequestCall* call, Side side) : call_(call), side_(side) {}

    void Begin(std::shared_ptr<RequestCall> self) {
      self_ = std::move(self);
      PdlibTsanRelease(this);
      StartRead(&event_);
      StartCall();
    }

    void OnReadDone(bool ok) override {
      PdlibTsanAcquire(this);
      if (!ok) return;  // the stream ended; OnDone follows
      call_->OnEvent(side_, event_);
      event_.Clear();
      PdlibTsanRelease(this);
      StartRead(&event_);
    }

    void OnDone(const grpc::Status& status) override {
      PdlibTsanAcquire(this);
      // The last reaction: dropping `keep` may destroy the call, and this reactor with it.
      std::shared_ptr<RequestCall> keep = std::move(self_);
      call_->OnSideDone(side_, status);
    }

   private:
    RequestCall* const call_;
    const Side side_;
    serving::HostEvent event_;
    std::shared_ptr<RequestCall> self_;
  };

  struct SideState {
    SideState(RequestCall* call, Side side, Host* h) : host(h), stream(call, side) {}
    Host* const host;
    grpc::ClientContext ctx;               // thread-safe (TryCancel)
    serving::HostGenerateRequest request;  // written before the RPC starts
    Stream stream;
    // Guarded by the call's mu_.
    bool done = false;
    grpc::Status status;
    bool has_result = false;
    serving::HostResult result;
    std::string cancelled_because;  // set when the router cancelled this side for the other's sake
  };

  static std::string Describe(const SideState& s) {
    return std::string(HostRoleName(s.host->role())) + " host " + s.host->address();
  }

  // Records `count` tokens as sent on. Returns the index of the first.
  int32_t RecordTokensLocked(size_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int32_t first = static_cast<int32_t>(output_ids_.size());
    const auto now = Clock::now();
    if (first == 0 && count > 0) first_token_at_ = now;
    if (count > 0) last_token_at_ = now;
    return first;
  }

  void OnEvent(Side side, const serving::HostEvent& event) {
    SideState& s = *sides_[side];
    if (event.has_token()) {
      // Only decode streams tokens (prefill's first token is in its HostResult).
      if (side != kDecodeSide) return;
      int32_t index = 0;
      {
        MutexLock lock(&mu_);
        if (s.has_result) return;  // nothing after the result counts
        index = RecordTokensLocked(1);
        output_ids_.push_back(event.token().token_id());
      }
      observer_->OnToken(event.token().token_id(), index);
      return;
    }
    if (!event.has_result()) return;  // an event of a newer host: ignore
    std::vector<int32_t> late;        // tokens in decode's result that were not streamed
    int32_t first_late = 0;
    bool ok = false;
    {
      MutexLock lock(&mu_);
      if (s.has_result) return;  // only the first result counts
      s.has_result = true;
      s.result = event.result();
      ok = s.result.ok();
      if (side == kDecodeSide && ok &&
          static_cast<size_t>(s.result.output_ids_size()) > output_ids_.size()) {
        late.assign(s.result.output_ids().begin() + static_cast<int>(output_ids_.size()),
                    s.result.output_ids().end());
        first_late = RecordTokensLocked(late.size());
        output_ids_.insert(output_ids_.end(), late.begin(), late.end());
      }
    }
    for (size_t i = 0; i < late.size(); ++i) {
      observer_->OnToken(late[i], first_late + static_cast<int32_t>(i));
    }
    if (!ok) {
      SettleOther(side, "cancelled after " + Describe(s) + " failed");
    } else if (side == kDecodeSide) {
      // The request has succeeded; prefill gets settle_time to end its call.
      SettleOther(side, Describe(*sides_[kPrefillSide]) + " sent no result within " +
                            std::to_string(core_->options_.settle_time.count()) +
                            " ms of decode finishing");
    }
  }

  // Gives the side other than `side` settle_time to end by itself, then cancels it. `why` is
  // what the result says about it if it has to be cancelled.
  void SettleOther(Side side, std::string why) {
    const Side other = side == kPrefillSide ? kDecodeSide : kPrefillSide;
    std::weak_ptr<RequestCall> weak = weak_from_this();
    core_->timers_->Add(Clock::now() + core_->options_.settle_time,
                        [weak, other, why = std::move(why)] {
                          if (auto call = weak.lock()) call->CancelSide(other, why);
                        });
  }

  void CancelSide(Side side, const std::string& why) {
    SideState& s = *sides_[side];
    {
      MutexLock lock(&mu_);
      if (s.done) return;  // (one with a result but an open stream may be cancelled: it is ok)
      if (s.cancelled_because.empty()) s.cancelled_because = why;
    }
    s.ctx.TryCancel();
  }

  void OnSideDone(Side side, const grpc::Status& status) {
    SideState& s = *sides_[side];
    bool failed = false, both_done = false, cancelled_by_us = false;
    {
      MutexLock lock(&mu_);
      s.done = true;
      s.status = status;
      failed = !(s.has_result && s.result.ok());
      both_done = sides_[kPrefillSide]->done && sides_[kDecodeSide]->done;
      cancelled_by_us = !s.cancelled_because.empty() || !cancel_status_.ok();
    }
    // Relaxed: a statistic for the policies and metrics.
    s.host->in_flight.fetch_sub(1, std::memory_order_relaxed);
    if (failed && !status.ok() && !cancelled_by_us) {
      s.host->RecordError("Generate: " + control::FromGrpcStatus(status).ToString(),
                          status.error_code() == grpc::StatusCode::UNAVAILABLE,
                          core_->pool_->options().unavailable_backoff);
    }
    if (!both_done) {
      if (failed) SettleOther(side, "cancelled after " + Describe(s) + " failed");
      return;
    }
    Finish();
  }

  // Both RPCs are done: builds the result and hands it to the observer.
  void Finish() {
    RequestResult r;
    r.room = room_;
    r.prefill_host = sides_[kPrefillSide]->host->address();
    r.decode_host = sides_[kDecodeSide]->host->address();
    r.prompt_tokens = static_cast<int32_t>(request_.prompt_ids.size());
    r.max_new_tokens = request_.max_new_tokens;
    {
      MutexLock lock(&mu_);
      finished_ = true;
      const auto now = Clock::now();
      r.output_ids = output_ids_;
      if (!output_ids_.empty()) r.ttft_us = Micros(first_token_at_ - received_);
      const SideState& p = *sides_[kPrefillSide];
      const SideState& d = *sides_[kDecodeSide];
      // Both hosts count the same bytes; decode's count stands in when prefill's result is late.
      if (p.has_result && p.result.ok()) {
        r.kv_bytes = p.result.kv_bytes();
      } else if (d.has_result) {
        r.kv_bytes = d.result.kv_bytes();
      }
      if (d.has_result) r.transfer_us = d.result.transfer_us();
      if (p.has_result && p.result.ok()) r.exposed_transfer_us = p.result.exposed_transfer_us();
      r.status = ComposeStatusLocked();
      r.latency_us =
          Micros((r.status.ok() && !output_ids_.empty() ? last_token_at_ : now) - received_);
      for (const auto& side : sides_) {
        if (!(side->has_result && side->result.ok()) && side->cancelled_because.empty() &&
            cancel_status_.ok()) {
          // Relaxed: a statistic.
          side->host->failures.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    // Relaxed: a statistic.
    if (!r.status.ok()) core_->requests_failed_.fetch_add(1, std::memory_order_relaxed);
    observer_->OnResult(r);
  }

  Status ComposeStatusLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    struct Part {
      int rank;  // 0: the host failed; 1: broke the protocol; 2: timed out; 3: cancelled by us
      StatusCode code;
      std::string text;
    };
    // Decode's ok result is the request's success unless prefill failed by itself (a result that
    // is not ok, or its call ended without one): pdlib lets decode finish only after every
    // prefill rank reported the transfer done, so a prefill result that is merely late (a slow
    // scheduler step; the router then cancels the call after settle_time) must not turn a
    // finished request into a failure. The call being cancelled afterwards does not either.
    const SideState& p = *sides_[kPrefillSide];
    const SideState& d = *sides_[kDecodeSide];
    const bool prefill_failed = (p.has_result && !p.result.ok()) ||
                                (p.done && !p.has_result && p.cancelled_because.empty());
    if (d.has_result && d.result.ok() && !prefill_failed) return Status::OK();
    std::vector<Part> parts;
    for (const auto& side_ptr : sides_) {
      const SideState& s = *side_ptr;
      if (s.has_result && s.result.ok()) continue;
      if (s.has_result) {
        StatusCode code = control::StatusCodeFromInt(s.result.code());
        if (code == StatusCode::kOk) code = StatusCode::kUnknown;  // "not ok" without a code
        parts.push_back(
            {0, code,
             Describe(s) + " failed: " + CodeName(code) + ": " +
                 (s.result.reason().empty() ? "(no reason given)" : s.result.reason())});
      } else if (!cancel_status_.ok()) {
        continue;  // the caller's reason, below
      } else if (s.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        std::string what = s.host->role() == HostRole::kDecode
                               ? std::to_string(output_ids_.size()) + " tokens, no result"
                               : "no result";
        parts.push_back({2, StatusCode::kDeadlineExceeded,
                         Describe(s) + " did not finish within the request timeout of " +
                             std::to_string(core_->options_.request_timeout.count()) + " ms (" +
                             what + ")"});
      } else if (!s.cancelled_because.empty()) {
        parts.push_back({3, StatusCode::kAborted, s.cancelled_because});
      } else if (!s.status.ok()) {
        const Status st = control::FromGrpcStatus(s.status);
        parts.push_back(
            {0, st.code(),
             Describe(s) + " failed: " + CodeName(st.code()) + ": " + std::string(st.message())});
      } else {
        parts.push_back(
            {1, StatusCode::kInternal, Describe(s) + " ended its stream without a result"});
      }
    }
    if (parts.empty() && cancel_status_.ok()) return Status::OK();
    std::stable_sort(parts.begin(), parts.end(),
                     [](const Part& a, const Part& b) { return a.rank < b.rank; });
    const bool have_real = !parts.empty() && parts.front().rank < 2;
    if (!have_real && !cancel_status_.ok()) return cancel_status_;
    std::string text;
    for (const Part& part : parts) {
      if (part.rank == 3 && parts.front().rank != 3) continue;  // a consequence, not a cause
      text += (text.empty() ? "" : "; ") + part.text;
    }
    return Status(parts.front().code, text);
  }

  RouterCore* const core_;
  const uint64_t room_;
  const RouterRequest request_;
  std::shared_ptr<RequestObserver> observer_;
  const Clock::time_point received_;
  std::array<std::unique_ptr<SideState>, 2> sides_;

  Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  Status cancel_status_ ABSL_GUARDED_BY(mu_);  // OK unless Cancel() was called
  std::vector<int32_t> output_ids_ ABSL_GUARDED_BY(mu_);
  Clock::time_point first_token_at_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_token_at_ ABSL_GUARDED_BY(mu_);
};

void RequestHandle::Cancel(const Status& why) const {
  if (auto call = call_.lock()) call->Cancel(why);
}

RouterCore::RouterCore(HostPool* pool, const RouterCoreOptions& options)
    : pool_(pool),
      options_(options),
      timers_(std::make_unique<Timers>()),
      rng_(options.seed),
      rooms_(options.seed) {
  control::KeepCallbackQueueAlive();  // callback-API clients: see lib/control/grpc_runtime.h
}

RouterCore::~RouterCore() { Stop(); }

StatusOr<RequestHandle> RouterCore::Submit(RouterRequest request,
                                           std::shared_ptr<RequestObserver> observer) {
  const auto received = Clock::now();
  Host* prefill = nullptr;
  Host* decode = nullptr;
  uint64_t room = 0;
  {
    MutexLock lock(&pick_mu_);
    const int p = PickHost(options_.policy, pool_->Loads(HostRole::kPrefill), rng_);
    const int d = PickHost(options_.policy, pool_->Loads(HostRole::kDecode), rng_);
    if (p < 0 || d < 0) return Status::FailedPrecondition("the router has no hosts");
    prefill = pool_->hosts(HostRole::kPrefill)[static_cast<size_t>(p)].get();
    decode = pool_->hosts(HostRole::kDecode)[static_cast<size_t>(d)].get();
    room = rooms_.Next();
    // Counted under the pick lock, so that the next pick sees them. Relaxed: statistics.
    prefill->in_flight.fetch_add(1, std::memory_order_relaxed);
    decode->in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  auto call = std::make_shared<RequestCall>(this, room, prefill, decode, std::move(request),
                                            std::move(observer), received);
  {
    MutexLock lock(&live_mu_);
    if (stopping_) {
      prefill->in_flight.fetch_sub(1, std::memory_order_relaxed);
      decode->in_flight.fetch_sub(1, std::memory_order_relaxed);
      return Status::Unavailable("the router is shutting down");
    }
    live_[room] = call;
  }
  requests_total_.fetch_add(1, std::memory_order_relaxed);
  prefill->requests.fetch_add(1, std::memory_order_relaxed);
  decode->requests.fetch_add(1, std::memory_order_relaxed);
  call->Start(prefill->load_info());
  return RequestHandle(call, room);
}

void RouterCore::CallStarted() {
  MutexLock lock(&live_mu_);
  ++live_count_;
}

void RouterCore::CallEnded(uint64_t room) {
  MutexLock lock(&live_mu_);
  live_.erase(room);
  --live_count_;
  live_cv_.SignalAll();
}

void RouterCore::BeginStop(const std::string& why) {
  std::vector<std::weak_ptr<RequestCall>> calls;
  {
    MutexLock lock(&live_mu_);
    stopping_ = true;
    for (const auto& [room, call] : live_) calls.push_back(call);
  }
  for (const auto& weak : calls) {
    if (auto call = weak.lock()) call->Cancel(Status::Unavailable(why));
  }
}

void RouterCore::Stop() {
  BeginStop("the router is shutting down");
  {
    MutexLock lock(&live_mu_);
    while (live_count_ > 0) live_cv_.Wait(&live_mu_);
  }
  timers_->Stop();
}

void RouterCore::AppendMetrics(std::string* out) const {
  int64_t in_flight = 0;
  {
    MutexLock lock(&live_mu_);
    in_flight = live_count_;
  }
  *out +=
      "# HELP pdlib_router_requests_total Requests the router dispatched.\n"
      "# TYPE pdlib_router_requests_total counter\n"
      "pdlib_router_requests_total " +
      std::to_string(requests_total_.load(std::memory_order_relaxed)) +
      "\n# HELP pdlib_router_requests_failed_total Dispatched requests that failed.\n"
      "# TYPE pdlib_router_requests_failed_total counter\n"
      "pdlib_router_requests_failed_total " +
      std::to_string(requests_failed_.load(std::memory_order_relaxed)) +
      "\n# HELP pdlib_router_requests_in_flight Requests dispatched and not yet ended.\n"
      "# TYPE pdlib_router_requests_in_flight gauge\n"
      "pdlib_router_requests_in_flight " +
      std::to_string(in_flight) + "\n";
  pool_->AppendMetrics(out);
}

}  // namespace pdlib::router
