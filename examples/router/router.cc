#include "examples/router/router.h"

#include <grpcpp/grpcpp.h>

#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <utility>

#include "examples/proto/pd_serving.grpc.pb.h"
#include "examples/router/completions.h"
#include "examples/router/core.h"
#include "examples/router/host_pool.h"
#include "examples/router/http_server.h"
#include "examples/router/request.h"
#include "examples/router/tokenizer.h"
#include "lib/base/mutex.h"
#include "lib/base/tsan.h"
#include "lib/control/grpc_runtime.h"
#include "lib/control/grpc_status.h"
#include "lib/control/net_address.h"

namespace pdlib::router {
namespace {

void ToProto(const RequestResult& r, serving::GenerateResult* out) {
  out->set_ok(r.status.ok());
  out->set_code(static_cast<int32_t>(r.status.code()));
  out->set_reason(std::string(r.status.message()));
  out->set_room(r.room);
  out->set_prefill_host(r.prefill_host);
  out->set_decode_host(r.decode_host);
  out->mutable_output_ids()->Add(r.output_ids.begin(), r.output_ids.end());
  out->set_ttft_us(r.ttft_us);
  out->set_latency_us(r.latency_us);
  out->set_transfer_us(r.transfer_us);
  out->set_exposed_transfer_us(r.exposed_transfer_us);
  out->set_kv_bytes(r.kv_bytes);
  out->set_prompt_tokens(r.prompt_tokens);
}

// One Router.Generate call: the request's events are queued and written one at a time; the call
// finishes after the GenerateResult is written (or the client is gone and the result came).
// Lock: mu_ only; gRPC calls (StartWrite, Finish) are made outside it, since a reaction may run
// inline, and nothing touches the reactor after Finish (OnDone deletes it).
class GenerateStream final : public grpc::ServerWriteReactor<serving::GenerateEvent> {
 public:
  GenerateStream(RouterCore* core, const serving::GenerateRequest& request,
                 int32_t default_max_new_tokens) {
    PdlibTsanRelease(this);
    std::span<const int32_t> ids(request.prompt_ids().data(),
                                 static_cast<size_t>(request.prompt_ids_size()));
    StatusOr<RouterRequest> r =
        MakeRouterRequest(ids, request.prompt(), request.max_new_tokens(), default_max_new_tokens);
    if (!r.ok()) {
      FinishWithoutResult(r.status());
      return;
    }
    StatusOr<RequestHandle> handle = core->Submit(*std::move(r), std::make_shared<Observer>(this));
    if (!handle.ok()) {
      FinishWithoutResult(handle.status());
      return;
    }
    MutexLock lock(&mu_);
    handle_ = *handle;
  }

  void OnWriteDone(bool ok) override {
    PdlibTsanAcquire(this);
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {  // the client is gone: drop what is queued, wait for the result to finish
        write_failed_ = true;
        pending_.clear();
      }
    }
    Flush();
  }

  void OnCancel() override {
    PdlibTsanAcquire(this);
    RequestHandle handle;
    {
      MutexLock lock(&mu_);
      handle = handle_;
    }
    handle.Cancel(Status::Cancelled("cancelled by the client"));
  }

  void OnDone() override {
    PdlibTsanAcquire(this);
    delete this;
  }

 private:
  // Forwards the request's events. Holds the stream by pointer: the stream finishes (and is
  // deleted) only after OnResult, the last call.
  class Observer final : public RequestObserver {
   public:
    explicit Observer(GenerateStream* stream) : stream_(stream) {}
    void OnToken(int32_t token_id, int32_t index) override {
      serving::GenerateEvent event;
      event.mutable_token()->set_token_id(token_id);
      event.mutable_token()->set_index(index);
      stream_->Push(std::move(event), /*last=*/false);
    }
    void OnResult(const RequestResult& result) override {
      serving::GenerateEvent event;
      ToProto(result, event.mutable_result());
      stream_->Push(std::move(event), /*last=*/true);
    }

   private:
    GenerateStream* const stream_;
  };

  void Push(serving::GenerateEvent event, bool last) {
    {
      MutexLock lock(&mu_);
      if (!write_failed_) pending_.push_back(std::move(event));
      if (last) last_queued_ = true;
    }
    Flush();
  }

  // Ends a call that was never dispatched (gRPC runs this Finish once it has bound the reactor).
  void FinishWithoutResult(const Status& status) {
    {
      MutexLock lock(&mu_);
      finished_ = true;
    }
    PdlibTsanRelease(this);
    Finish(control::ToGrpcStatus(status));
  }

  // Starts the next write, or the Finish once the result is written and no write is in flight.
  void Flush() {
    bool write = false, finish = false;
    {
      MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (!pending_.empty()) {
        out_ = std::move(pending_.front());
        pending_.pop_front();
        writing_ = write = true;
      } else if (last_queued_) {
        finished_ = finish = true;
      }
    }
    PdlibTsanRelease(this);
    if (write) StartWrite(&out_);
    if (finish) Finish(grpc::Status::OK);
  }

  Mutex mu_;
  RequestHandle handle_ ABSL_GUARDED_BY(mu_);
  std::deque<serving::GenerateEvent> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool last_queued_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  serving::GenerateEvent out_;  // owned by the write in flight
};

class RouterService final : public serving::Router::CallbackService {
 public:
  RouterService(RouterCore* core, int32_t default_max_new_tokens)
      : core_(core), default_max_new_tokens_(default_max_new_tokens) {}

  grpc::ServerWriteReactor<serving::GenerateEvent>* Generate(
      grpc::CallbackServerContext* /*ctx*/, const serving::GenerateRequest* request) override {
    // Pairs with the acquire after Server::Wait() in Shutdown: the service is destroyed after
    // its last call, an order gRPC keeps invisibly to TSan.
    PdlibTsanRelease(this);
    return new GenerateStream(core_, *request, default_max_new_tokens_);
  }

 private:
  RouterCore* const core_;
  const int32_t default_max_new_tokens_;
};

// Collects one request's tokens and result for an HTTP connection thread.
class QueueObserver final : public RequestObserver {
 public:
  void OnToken(int32_t token_id, int32_t /*index*/) override {
    {
      MutexLock lock(&mu_);
      tokens_.push_back(token_id);
    }
    cv_.Signal();
  }
  void OnResult(const RequestResult& result) override {
    {
      MutexLock lock(&mu_);
      result_ = result;
    }
    cv_.Signal();
  }
  // Waits up to `timeout` for news; appends the new tokens to `tokens` and returns the result
  // once it is there (every token comes before it).
  std::optional<RequestResult> Wait(std::chrono::milliseconds timeout,
                                    std::vector<int32_t>* tokens) {
    MutexLock lock(&mu_);
    if (tokens_.empty() && !result_) cv_.WaitFor(&mu_, timeout);
    tokens->insert(tokens->end(), tokens_.begin(), tokens_.end());
    tokens_.clear();
    return result_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  std::optional<RequestResult> result_ ABSL_GUARDED_BY(mu_);
};

constexpr std::string_view kJson = "application/json";

}  // namespace

struct Router::Rep {
  RouterOptions options;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<RouterCore> core;
  std::unique_ptr<RouterService> service;
  std::unique_ptr<grpc::Server> server;
  int32_t grpc_port = 0;
  std::unique_ptr<HttpServer> http;
  std::once_flag shutdown_once;

  void HandleHttp(const HttpRequest& request, HttpResponder* http) {
    const std::string_view path = request.path;
    const bool get = request.method == "GET";
    if (path == "/health") {
      if (!get) return MethodNotAllowed(http, "GET");
      http->Respond(200, "text/plain", "ok\n");
    } else if (path == "/metrics") {
      if (!get) return MethodNotAllowed(http, "GET");
      std::string text;
      core->AppendMetrics(&text);
      http->Respond(200, "text/plain; version=0.0.4", std::move(text));
    } else if (path == "/v1/completions") {
      if (request.method != "POST") return MethodNotAllowed(http, "POST");
      Complete(request, http);
    } else {
      http->Respond(404, kJson,
                    FormatError(Status::NotFound("no endpoint " + std::string(path) +
                                                 " (try POST /v1/completions, GET /health, "
                                                 "GET /metrics)"),
                                nullptr));
    }
  }

  static void MethodNotAllowed(HttpResponder* http, std::string_view allowed) {
    http->Respond(
        405, kJson,
        FormatError(Status::InvalidArgument("method not allowed; use " + std::string(allowed)),
                    nullptr));
  }

  // One HTTP completion in progress. The handler waits for its first text (a stream) or its
  // result; a stream's producer then carries it on, on the same thread, after the head is sent.
  struct HttpCompletion {
    std::shared_ptr<QueueObserver> observer = std::make_shared<QueueObserver>();
    std::optional<RequestHandle> handle;
    bool stream = false;
    int64_t created = 0;
    StreamDetokenizer detokenizer;
    bool cancelled = false;

    void Cancel() {
      if (!cancelled) handle->Cancel(Status::Cancelled("the HTTP client disconnected"));
      cancelled = true;
    }
    // Waits up to 100 ms for news: new text (streams only) and, once there, the result.
    std::optional<RequestResult> Wait(std::string* text) {
      std::vector<int32_t> tokens;
      std::optional<RequestResult> result = observer->Wait(std::chrono::milliseconds(100), &tokens);
      if (stream && !cancelled) {
        for (int32_t id : tokens) *text += detokenizer.Feed(id);
      }
      return result;
    }
    std::string Chunk(const std::string& text) const {
      return FormatCompletionChunk(handle->room(), created, text);
    }
    // The events that end a stream: the pending `text`, then the last chunk or the error.
    std::string Ending(const RequestResult& result, const std::string& text) {
      std::string events = text.empty() ? "" : Chunk(text);
      if (!result.status.ok())
        return events + "data: " + FormatError(result.status, &result) + "\n\n";
      return events + FormatCompletionLastChunk(result, created, detokenizer.Finish());
    }
  };

  void Complete(const HttpRequest& request, HttpResponder* http) {
    StatusOr<CompletionRequest> parsed =
        ParseCompletionRequest(request.body, options.default_max_new_tokens);
    if (!parsed.ok()) {
      http->Respond(400, kJson, FormatError(parsed.status(), nullptr));
      return;
    }
    auto c = std::make_shared<HttpCompletion>();
    c->stream = parsed->stream;
    StatusOr<RequestHandle> handle = core->Submit(std::move(parsed->request), c->observer);
    if (!handle.ok()) {
      http->Respond(HttpStatusFor(handle.status().code()), kJson,
                    FormatError(handle.status(), nullptr));
      return;
    }
    c->handle = *std::move(handle);
    c->created = static_cast<int64_t>(std::time(nullptr));
    std::string text;
    while (true) {
      std::optional<RequestResult> result = c->Wait(&text);
      if (result) {
        if (!result->status.ok() && text.empty()) {
          http->Respond(HttpStatusFor(result->status.code()), kJson,
                        FormatError(result->status, &*result));
        } else if (c->stream) {
          http->Stream("text/event-stream",
                       [events = c->Ending(*result, text)](HttpStream* s) { s->Write(events); });
        } else {
          http->Respond(200, kJson, FormatCompletion(*result, c->created));
        }
        return;
      }
      if (!text.empty()) break;  // a stream's first text: send the head, go on streaming
      // Keep waiting for the result after cancelling: it comes quickly, and the response (or
      // the write that fails) then ends the connection cleanly.
      if (!c->cancelled && http->Gone()) c->Cancel();
    }
    http->Stream("text/event-stream", [c, first = std::move(text)](HttpStream* s) {
      if (!s->Write(c->Chunk(first))) c->Cancel();
      std::string more;
      while (true) {
        std::optional<RequestResult> result = c->Wait(&more);
        if (result) {
          if (!c->cancelled) s->Write(c->Ending(*result, more));
          return;
        }
        if (!more.empty() && !c->cancelled && !s->Write(c->Chunk(more))) c->Cancel();
        more.clear();
        if (!c->cancelled && s->Gone()) c->Cancel();
      }
    });
  }
};

Router::Router(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

StatusOr<std::unique_ptr<Router>> Router::Start(const RouterOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument("--port " + std::to_string(options.port) +
                                   " out of range [0, 65535]");
  }
  if (options.http_port < -1 || options.http_port > 65535) {
    return Status::InvalidArgument("--http-port " + std::to_string(options.http_port) +
                                   " out of range [-1, 65535]");
  }
  if (options.default_max_new_tokens < 1) {
    return Status::InvalidArgument("--max-new-tokens must be >= 1");
  }
  if (options.request_timeout.count() <= 0 || options.startup_timeout.count() < 0 ||
      options.settle_time.count() < 0 || options.unavailable_backoff.count() < 0) {
    return Status::InvalidArgument(
        "request timeout must be > 0 ms; startup timeout, settle time and backoff >= 0 ms");
  }
  auto rep = std::make_unique<Rep>();
  rep->options = options;

  HostPoolOptions pool_options;
  pool_options.prefill = options.prefill_hosts;
  pool_options.decode = options.decode_hosts;
  pool_options.poll_interval = options.load_poll_interval;
  pool_options.unavailable_backoff = options.unavailable_backoff;
  StatusOr<std::unique_ptr<HostPool>> pool = HostPool::Create(pool_options);
  if (!pool.ok()) return pool.status();
  rep->pool = *std::move(pool);
  if (Status s = rep->pool->WaitReady(options.startup_timeout, options.progress); !s.ok()) {
    return s;
  }
  for (const auto& host : rep->pool->hosts(HostRole::kPrefill)) {
    if (host->load_info().bootstrap_port == 0 && options.progress) {
      options.progress("warning: prefill host " + host->address() +
                       " reported no bootstrap server (bootstrap_port 0); decode hosts will not "
                       "find its KV");
    }
  }
  rep->pool->StartPolling();

  RouterCoreOptions core_options;
  core_options.policy = options.policy;
  core_options.seed = options.seed
                          ? *options.seed
                          : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  core_options.request_timeout = options.request_timeout;
  core_options.settle_time = options.settle_time;
  rep->core = std::make_unique<RouterCore>(rep->pool.get(), core_options);

  control::KeepCallbackQueueAlive();  // a callback-API server: see lib/control/grpc_runtime.h
  rep->service = std::make_unique<RouterService>(rep->core.get(), options.default_max_new_tokens);
  const std::string address = control::JoinHostPort(options.host, options.port);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &rep->grpc_port);
  builder.RegisterService(rep->service.get());
  rep->server = builder.BuildAndStart();
  if (rep->server == nullptr || rep->grpc_port == 0) {
    return Status::Unavailable("router: cannot listen on " + address +
                               " (port in use, or host not a local address?)");
  }

  if (options.http_port >= 0) {
    HttpServerOptions http_options;
    http_options.host = options.host;
    http_options.port = options.http_port;
    http_options.max_connections = options.max_http_connections;
    http_options.max_body_bytes = options.max_http_body_bytes;
    Rep* r = rep.get();
    StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
        http_options,
        [r](const HttpRequest& request, HttpResponder* http) { r->HandleHttp(request, http); });
    if (!http.ok()) {
      rep->server->Shutdown();
      return http.status();
    }
    rep->http = *std::move(http);
  }
  return std::unique_ptr<Router>(new Router(std::move(rep)));
}

Router::~Router() { Shutdown(); }

void Router::Shutdown() {
  std::call_once(rep_->shutdown_once, [this] {
    // Requests first, so that every handler and stream gets its (UNAVAILABLE) result promptly.
    rep_->core->BeginStop("the router is shutting down");
    if (rep_->http) rep_->http->Shutdown();
    rep_->server->Shutdown(std::chrono::system_clock::now());
    rep_->server->Wait();
    PdlibTsanAcquire(rep_->service.get());
    rep_->core->Stop();
    rep_->pool->StopPolling();
  });
}

int32_t Router::grpc_port() const { return rep_->grpc_port; }

int32_t Router::http_port() const { return rep_->http ? rep_->http->port() : -1; }

std::string Router::MetricsText() const {
  std::string text;
  rep_->core->AppendMetrics(&text);
  return text;
}

}  // namespace pdlib::router
