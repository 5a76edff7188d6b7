#include "lib/control/bootstrap_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/base/tsan.h"
#include "lib/control/bootstrap_table.h"
#include "lib/control/grpc_runtime.h"
#include "lib/control/grpc_status.h"
#include "lib/control/net_address.h"
#include "lib/control/proto_convert.h"
#include "lib/proto/pdlib.grpc.pb.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {

namespace pb = ::pdlib::wire::v1;

// Callback-API handlers: each answers inline from the table, so no reactor outlives its call.
class BootstrapService final : public pb::Bootstrap::CallbackService {
 public:
  BootstrapService(BootstrapTable* table, const ControlSecurity* security)
      : table_(table), security_(security) {}

  grpc::ServerUnaryReactor* RegisterRank(grpc::CallbackServerContext* ctx,
                                         const pb::RegisterRankRequest* request,
                                         pb::RegisterRankResponse* response) override {
    return Answer(ctx, [&]() -> Status {
      StatusOr<RankRegistration> reg = FromProto(*request);
      if (!reg.ok()) return reg.status();
      StatusOr<RegisterResult> result = table_->Register(*reg);
      if (!result.ok()) return result.status();
      ToProto(*result, response);
      return Status::OK();
    });
  }

  grpc::ServerUnaryReactor* UnregisterRank(grpc::CallbackServerContext* ctx,
                                           const pb::UnregisterRankRequest* request,
                                           pb::UnregisterRankResponse* response) override {
    return Answer(ctx, [&]() -> Status {
      const RankId id{request->dp_rank(), request->tp_rank(), request->pp_rank()};
      StatusOr<bool> removed = table_->Unregister(id, request->host(), request->port());
      if (!removed.ok()) return removed.status();
      response->set_removed(*removed);
      response->set_ranks_registered(table_->ranks_registered());
      return Status::OK();
    });
  }

  grpc::ServerUnaryReactor* GetParallelInfo(grpc::CallbackServerContext* ctx,
                                            const pb::GetParallelInfoRequest* /*request*/,
                                            pb::GetParallelInfoResponse* response) override {
    return Answer(ctx, [&]() -> Status {
      StatusOr<ParallelInfo> info = table_->GetParallelInfo();
      if (!info.ok()) return info.status();
      ToProto(*info, response);
      return Status::OK();
    });
  }

  grpc::ServerUnaryReactor* GetRankAddress(grpc::CallbackServerContext* ctx,
                                           const pb::GetRankAddressRequest* request,
                                           pb::GetRankAddressResponse* response) override {
    return Answer(ctx, [&]() -> Status {
      StatusOr<RankAddress> address = table_->GetRankAddress(FromProto(*request));
      if (!address.ok()) return address.status();
      ToProto(*address, response);
      return Status::OK();
    });
  }

  grpc::ServerUnaryReactor* ReportRoomFailures(
      grpc::CallbackServerContext* ctx, const pb::ReportRoomFailuresRequest* request,
      pb::ReportRoomFailuresResponse* /*response*/) override {
    return Answer(ctx, [&]() -> Status {
      std::vector<RoomFailure> failures;
      failures.reserve(std::min<size_t>(request->failures_size(), kMaxRoomFailuresPerCall + 1));
      for (const auto& f : request->failures()) {
        failures.push_back({f.room(), f.reason()});
        if (failures.size() > kMaxRoomFailuresPerCall) break;  // refused below
      }
      return table_->ReportRoomFailures(failures, absl::Now());
    });
  }

  grpc::ServerUnaryReactor* GetRoomFailures(grpc::CallbackServerContext* ctx,
                                            const pb::GetRoomFailuresRequest* request,
                                            pb::GetRoomFailuresResponse* response) override {
    return Answer(ctx, [&]() -> Status {
      if (static_cast<size_t>(request->rooms_size()) > kMaxRoomFailuresPerCall) {
        return Status::InvalidArgument(absl::StrFormat(
            "%d rooms in one lookup (at most %d)", request->rooms_size(), kMaxRoomFailuresPerCall));
      }
      std::vector<uint64_t> rooms(request->rooms().begin(), request->rooms().end());
      auto failed = table_->RoomFailures(rooms, absl::Now());
      if (!failed.ok()) return failed.status();
      for (const RoomFailure& f : *failed) {
        auto* out = response->add_failures();
        out->set_room(f.room);
        out->set_reason(f.reason);
      }
      return Status::OK();
    });
  }

 private:
  template <typename Handler>
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, Handler&& handler) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    grpc::Status status = CheckSecret(*security_, *ctx);
    if (status.ok()) status = ToGrpcStatus(handler());
    // Pairs with the acquire after Server::Wait(): the handler's reads of this service happen
    // before its destruction (ordered by gRPC, invisibly to TSan).
    PdlibTsanRelease(this);
    reactor->Finish(std::move(status));
    return reactor;
  }

  BootstrapTable* const table_;
  const ControlSecurity* const security_;
};

Status ValidateOptions(const BootstrapServerOptions& options) {
  if (options.host.empty()) return Status::InvalidArgument("bootstrap server host is empty");
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument(
        absl::StrFormat("bootstrap server port %d out of range [0, 65535]", options.port));
  }
  if (options.shutdown_grace.count() < 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "bootstrap server shutdown_grace %d ms is negative", options.shutdown_grace.count()));
  }
  return Status::OK();
}

}  // namespace

struct BootstrapServer::Rep {
  explicit Rep(const BootstrapServerOptions& opts)
      : options(opts), service(&table, &options.security) {}

  const BootstrapServerOptions options;
  int32_t port = 0;
  BootstrapTable table;
  BootstrapService service;  // must outlive `server`, so it is declared before it
  std::unique_ptr<grpc::Server> server;
  Mutex shutdown_mu;
  bool shut_down ABSL_GUARDED_BY(shutdown_mu) = false;
};

const char* BootstrapServer::ServiceName() { return pb::Bootstrap::service_full_name(); }

StatusOr<std::unique_ptr<BootstrapServer>> BootstrapServer::Start(
    const BootstrapServerOptions& options) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;

  // gRPC's built-in grpc.health.v1 service is switched on process-wide and picked up by every
  // server built afterwards; the flag is a plain global, so set it once.
  static std::once_flag enable_health_once;
  std::call_once(enable_health_once, [] { grpc::EnableDefaultHealthCheckService(true); });

  auto rep = std::make_unique<Rep>(options);
  const std::string requested = JoinHostPort(options.host, options.port);
  KeepCallbackQueueAlive();  // a callback-API server: see grpc_runtime.h
  grpc::ServerBuilder builder;
  // Without this gRPC sets SO_REUSEPORT, and a second server on a taken port would start and
  // silently share (or steal) the first one's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  auto creds = MakeServerCredentials(options.security);
  if (!creds.ok()) return creds.status().WithPrefix("bootstrap server");
  builder.AddListeningPort(requested, *creds, &rep->port);
  builder.RegisterService(&rep->service);
  rep->server = builder.BuildAndStart();
  if (rep->server == nullptr || rep->port == 0) {
    return Status::Unavailable(absl::StrFormat(
        "bootstrap server could not listen on %s (port in use, or host not a local address?)",
        requested));
  }
  grpc::HealthCheckServiceInterface* health = rep->server->GetHealthCheckService();
  if (health == nullptr) {
    return Status::Internal("gRPC did not create its default health check service");
  }
  health->SetServingStatus(true);
  health->SetServingStatus(ServiceName(), true);
  PDLIB_LOG(kInfo, "bootstrap server listening on %s", JoinHostPort(options.host, rep->port));
  return std::unique_ptr<BootstrapServer>(new BootstrapServer(std::move(rep)));
}

BootstrapServer::BootstrapServer(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

BootstrapServer::~BootstrapServer() { Shutdown(); }

void BootstrapServer::Shutdown() {
  MutexLock lock(&rep_->shutdown_mu);
  if (rep_->shut_down) return;
  rep_->shut_down = true;
  if (grpc::HealthCheckServiceInterface* health = rep_->server->GetHealthCheckService()) {
    health->SetServingStatus(false);
  }
  rep_->server->Shutdown(std::chrono::system_clock::now() + rep_->options.shutdown_grace);
  rep_->server->Wait();
  PdlibTsanAcquire(&rep_->service);
  PDLIB_LOG(kInfo, "bootstrap server on %s stopped", address());
}

const std::string& BootstrapServer::host() const { return rep_->options.host; }

int32_t BootstrapServer::port() const { return rep_->port; }

std::string BootstrapServer::address() const {
  return JoinHostPort(rep_->options.host, rep_->port);
}

int32_t BootstrapServer::ranks_registered() const { return rep_->table.ranks_registered(); }

}  // namespace control
}  // namespace v1
}  // namespace pdlib
