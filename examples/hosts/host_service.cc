#include "examples/hosts/host_service.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

#include "examples/proto/pd_serving.grpc.pb.h"

namespace pdlib::hosts {
namespace {

namespace pb = ::pdlib::serving;

void ToProto(const HostRequestResult& r, pb::HostResult* out) {
  out->set_ok(r.status.ok());
  out->set_code(static_cast<int32_t>(r.status.code()));
  out->set_reason(std::string(r.status.message()));
  out->mutable_output_ids()->Add(r.output_ids.begin(), r.output_ids.end());
  out->set_first_token_us(r.first_token_us);
  out->set_exposed_transfer_us(r.exposed_transfer_us);
  out->set_transfer_us(r.transfer_us);
  out->set_finish_us(r.finish_us);
  out->set_kv_bytes(r.kv_bytes);
}

// One Generate call's events, from the host's coordinator thread (callbacks) to the handler
// thread that writes them. Shared: the host may still call back after the handler returned (a
// cancelled call), and then the events are dropped.
class EventQueue {
 public:
  void Push(pb::HostEvent event, bool last) {
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      events_.push_back(std::move(event));
      if (last) closed_ = true;
    }
    cv_.notify_all();
  }
  // The next event, or false when none came within `wait`. *last is set on the final event.
  bool Pop(pb::HostEvent* event, bool* last, std::chrono::milliseconds wait) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, wait, [&] { return !events_.empty(); })) return false;
    *event = std::move(events_.front());
    events_.pop_front();
    *last = closed_ && events_.empty();
    return true;
  }
  void Close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    events_.clear();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<pb::HostEvent> events_;  // guarded by mu_
  bool closed_ = false;               // guarded by mu_: no event is taken after the result
};

// The sync API: each Generate call holds a gRPC thread while its request runs, and every gRPC
// call is made on that thread. The host's events come from its own coordinator thread; with the
// callback API that thread would start writes whose bookkeeping (in gRPC's header-only code)
// gRPC's uninstrumented completion queue then orders against its reaction threads, which
// ThreadSanitizer cannot see. Here the only hand-off is EventQueue's mutex.
class HostServiceImpl final : public pb::Host::Service {
 public:
  explicit HostServiceImpl(Host* host) : host_(host) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const pb::HostGenerateRequest* in,
                        grpc::ServerWriter<pb::HostEvent>* writer) override {
    auto events = std::make_shared<EventQueue>();
    HostRequest request;
    request.room = in->room();
    request.prompt.assign(in->prompt_ids().begin(), in->prompt_ids().end());
    request.max_new_tokens = in->max_new_tokens();
    request.bootstrap.host = in->bootstrap_host();
    request.bootstrap.port = static_cast<uint16_t>(in->bootstrap_port());
    if (in->prefill_dp_rank() >= 0) request.prefill_dp_rank = in->prefill_dp_rank();
    auto on_token = [events](int32_t index, int32_t token) {
      pb::HostEvent e;
      e.mutable_token()->set_token_id(token);
      e.mutable_token()->set_index(index);
      events->Push(std::move(e), /*last=*/false);
    };
    auto on_result = [events](HostRequestResult r) {
      pb::HostEvent e;
      ToProto(r, e.mutable_result());
      events->Push(std::move(e), /*last=*/true);
    };
    if (in->bootstrap_port() > 65535) {
      on_result(HostRequestResult::Failed(Status::InvalidArgument(
          "bootstrap_port " + std::to_string(in->bootstrap_port()) + " is not a port")));
    } else {
      host_->Submit(std::move(request), {.on_token = on_token, .on_result = on_result});
    }
    while (true) {
      pb::HostEvent e;
      bool last = false;
      // Wakes up now and then to notice a cancelled call (client gone, server shutting down).
      if (!events->Pop(&e, &last, std::chrono::milliseconds(100))) {
        if (ctx->IsCancelled()) {
          events->Close();
          return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        }
        continue;
      }
      if (!writer->Write(e)) {
        events->Close();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      }
      if (last) return grpc::Status::OK;
    }
  }

  grpc::Status GetLoad(grpc::ServerContext* /*ctx*/, const pb::LoadRequest* /*request*/,
                       pb::LoadReply* reply) override {
    const HostLoad load = host_->Load();
    reply->set_role(std::string(RoleName(load.role)));
    reply->set_tp_size(load.tp_size);
    reply->set_pp_size(load.pp_size);
    reply->set_running(load.running);
    reply->set_queued(load.queued);
    reply->set_dp_size(1);
    if (load.role == Role::kPrefill) {
      reply->set_bootstrap_host(load.bootstrap.host);
      reply->set_bootstrap_port(load.bootstrap.port);
    }
    return grpc::Status::OK;
  }

 private:
  Host* const host_;
};

}  // namespace

struct HostService::Rep {
  std::string host;
  int32_t port = 0;
  std::unique_ptr<HostServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::once_flag shutdown_once;
};

StatusOr<std::unique_ptr<HostService>> HostService::Start(const HostServiceOptions& options,
                                                          Host* host) {
  if (host == nullptr) return Status::InvalidArgument("host service: no host");
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument("host service: port " + std::to_string(options.port) +
                                   " out of range [0, 65535]");
  }
  auto rep = std::make_unique<Rep>();
  rep->host = options.host;
  rep->service = std::make_unique<HostServiceImpl>(host);
  const std::string address = options.host + ":" + std::to_string(options.port);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &rep->port);
  builder.RegisterService(rep->service.get());
  rep->server = builder.BuildAndStart();
  if (rep->server == nullptr || rep->port == 0) {
    return Status::Unavailable("host service: cannot listen on " + address +
                               " (port in use, or host not a local address?)");
  }
  return std::unique_ptr<HostService>(new HostService(std::move(rep)));
}

HostService::HostService(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

HostService::~HostService() { Shutdown(); }

void HostService::Shutdown(std::chrono::milliseconds grace) {
  std::call_once(rep_->shutdown_once, [&] {
    rep_->server->Shutdown(std::chrono::system_clock::now() + grace);
    rep_->server->Wait();
  });
}

int32_t HostService::port() const { return rep_->port; }

std::string HostService::address() const { return rep_->host + ":" + std::to_string(rep_->port); }

}  // namespace pdlib::hosts
