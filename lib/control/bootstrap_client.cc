#include "lib/control/bootstrap_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <random>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/control/grpc_status.h"
#include "lib/control/net_address.h"
#include "lib/control/proto_convert.h"
#include "lib/proto/health.grpc.pb.h"
#include "lib/proto/pdlib.grpc.pb.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {

namespace pb = ::pdlib::wire::v1;
namespace health_pb = ::grpc::health::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Status ValidateOptions(const BootstrapClientOptions& o) {
  auto positive = [](const char* field, milliseconds value) {
    if (value.count() > 0) return Status::OK();
    return Status::InvalidArgument(
        absl::StrFormat("bootstrap client %s %d ms must be positive", field, value.count()));
  };
  for (Status s :
       {positive("rpc_timeout", o.rpc_timeout), positive("register_deadline", o.register_deadline),
        positive("initial_backoff", o.initial_backoff), positive("max_backoff", o.max_backoff)}) {
    if (!s.ok()) return s;
  }
  if (o.register_max_attempts < 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "bootstrap client register_max_attempts %d is negative", o.register_max_attempts));
  }
  if (!(o.backoff_multiplier >= 1.0)) {
    return Status::InvalidArgument(absl::StrFormat(
        "bootstrap client backoff_multiplier %g must be at least 1", o.backoff_multiplier));
  }
  return Status::OK();
}

bool Retryable(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
}

// +-20% so that the ranks of a deployment started together do not retry in lockstep.
milliseconds Jitter(milliseconds d) {
  thread_local std::minstd_rand rng{std::random_device{}()};
  std::uniform_real_distribution<double> factor(0.8, 1.2);
  return milliseconds(std::max<int64_t>(1, static_cast<int64_t>(d.count() * factor(rng))));
}

}  // namespace

struct BootstrapClient::Rep {
  std::string address;
  BootstrapClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Bootstrap::Stub> stub;
  std::unique_ptr<health_pb::Health::Stub> health_stub;

  Mutex mu;
  CondVar cancelled_cv;  // wakes a RegisterRank backoff pause on Cancel()
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_set<grpc::ClientContext*> in_flight ABSL_GUARDED_BY(mu);

  // One attempt of `rpc(context)` with `timeout`; the error message names the server and method.
  template <typename Rpc>
  Status Attempt(const char* method, milliseconds timeout, Rpc&& rpc) ABSL_LOCKS_EXCLUDED(mu) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    AttachSecret(options.security, &context);
    {
      MutexLock lock(&mu);
      if (cancelled) return CancelledStatus(method);
      in_flight.insert(&context);
    }
    const grpc::Status status = rpc(&context);
    {
      MutexLock lock(&mu);
      in_flight.erase(&context);
    }
    return Describe(method, timeout, FromGrpcStatus(status));
  }

  Status CancelledStatus(const char* method) const {
    return Status::Cancelled(absl::StrFormat("bootstrap %s: %s cancelled", address, method));
  }

  Status Describe(const char* method, milliseconds timeout, const Status& s) const {
    switch (s.code()) {
      case StatusCode::kOk: return s;
      case StatusCode::kUnavailable:
        return Status(s.code(), absl::StrFormat("bootstrap %s unreachable (%s): %s", address,
                                                method, s.message()));
      case StatusCode::kDeadlineExceeded:
        return Status(s.code(), absl::StrFormat("bootstrap %s did not answer %s within %d ms: %s",
                                                address, method, timeout.count(), s.message()));
      default:
        return Status(s.code(),
                      absl::StrFormat("bootstrap %s: %s: %s", address, method, s.message()));
    }
  }

  // Sleeps for `pause` unless cancelled first; returns false when cancelled.
  bool PauseUnlessCancelled(milliseconds pause) ABSL_LOCKS_EXCLUDED(mu) {
    const auto until = std::chrono::steady_clock::now() + pause;
    MutexLock lock(&mu);
    while (!cancelled) {
      auto left = until - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      cancelled_cv.WaitFor(&mu, left);
    }
    return !cancelled;
  }
};

StatusOr<std::unique_ptr<BootstrapClient>> BootstrapClient::Create(
    std::string_view host, int32_t port, const BootstrapClientOptions& options) {
  if (host.empty()) return Status::InvalidArgument("bootstrap host is empty");
  if (port <= 0 || port > 65535) {
    return Status::InvalidArgument(
        absl::StrFormat("bootstrap port %d out of range [1, 65535]", port));
  }
  if (Status s = ValidateOptions(options); !s.ok()) return s;

  auto rep = std::make_unique<Rep>();
  rep->address = JoinHostPort(host, port);
  rep->options = options;
  grpc::ChannelArguments args;
  // Reconnect about as eagerly as RegisterRank retries (gRPC's defaults wait 1 s, growing to
  // 120 s), and keep this client's reconnect backoff its own rather than shared process-wide.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<int64_t>(options.initial_backoff.count(), 1000)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<int64_t>(options.max_backoff.count(), 120000)));
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto creds = MakeChannelCredentials(options.security);
  if (!creds.ok()) return creds.status().WithPrefix("bootstrap client");
  rep->channel = grpc::CreateCustomChannel(rep->address, *creds, args);
  rep->stub = pb::Bootstrap::NewStub(rep->channel);
  rep->health_stub = health_pb::Health::NewStub(rep->channel);
  return std::unique_ptr<BootstrapClient>(new BootstrapClient(std::move(rep)));
}

BootstrapClient::BootstrapClient(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}

BootstrapClient::~BootstrapClient() = default;

const std::string& BootstrapClient::address() const { return rep_->address; }

void BootstrapClient::Cancel() {
  MutexLock lock(&rep_->mu);
  rep_->cancelled = true;
  for (grpc::ClientContext* context : rep_->in_flight) context->TryCancel();
  rep_->cancelled_cv.SignalAll();
}

StatusOr<RegisterResult> BootstrapClient::RegisterRank(const RankRegistration& registration) {
  const BootstrapClientOptions& o = rep_->options;
  pb::RegisterRankRequest request;
  ToProto(registration, &request);

  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + o.register_deadline;
  milliseconds backoff = o.initial_backoff;
  Status last;
  int32_t attempts = 0;
  while (true) {
    const auto remaining = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    const milliseconds timeout = std::max(milliseconds(1), std::min(o.rpc_timeout, remaining));
    pb::RegisterRankResponse response;
    ++attempts;
    last = rep_->Attempt("RegisterRank", timeout, [&](grpc::ClientContext* context) {
      return rep_->stub->RegisterRank(context, request, &response);
    });
    if (last.ok()) {
      if (attempts > 1) {
        PDLIB_LOG(kInfo, "bootstrap %s: prefill rank %s registered after %d attempts",
                  rep_->address, RankIdString(registration.rank_id()), attempts);
      }
      return FromProto(response);
    }
    if (!Retryable(last)) return last;
    if (o.register_max_attempts > 0 && attempts >= o.register_max_attempts) break;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    PDLIB_LOG(kDebug, "bootstrap %s: RegisterRank attempt %d failed, retrying in ~%d ms: %s",
              rep_->address, attempts, backoff.count(), last.message());
    if (!rep_->PauseUnlessCancelled(std::min(Jitter(backoff), left))) {
      return rep_->CancelledStatus("RegisterRank");
    }
    backoff =
        std::min(o.max_backoff, milliseconds(static_cast<int64_t>(
                                    static_cast<double>(backoff.count()) * o.backoff_multiplier)));
  }
  const auto elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return Status(last.code(), absl::StrFormat("%s (gave up after %d attempts in %d ms)",
                                             last.message(), attempts, elapsed.count()));
}

StatusOr<bool> BootstrapClient::UnregisterRank(const RankId& id, std::string_view host,
                                               uint32_t port) {
  pb::UnregisterRankRequest request;
  request.set_dp_rank(id.dp_rank);
  request.set_tp_rank(id.tp_rank);
  request.set_pp_rank(id.pp_rank);
  request.set_host(std::string(host));
  request.set_port(port);
  pb::UnregisterRankResponse response;
  Status s =
      rep_->Attempt("UnregisterRank", rep_->options.rpc_timeout, [&](grpc::ClientContext* context) {
        return rep_->stub->UnregisterRank(context, request, &response);
      });
  if (!s.ok()) return s;
  return response.removed();
}

StatusOr<ParallelInfo> BootstrapClient::GetParallelInfo() {
  pb::GetParallelInfoRequest request;
  pb::GetParallelInfoResponse response;
  Status s = rep_->Attempt("GetParallelInfo", rep_->options.rpc_timeout,
                           [&](grpc::ClientContext* context) {
                             return rep_->stub->GetParallelInfo(context, request, &response);
                           });
  if (!s.ok()) return s;
  return FromProto(response);
}

StatusOr<RankAddress> BootstrapClient::GetRankAddress(const RankId& id) {
  pb::GetRankAddressRequest request;
  ToProto(id, &request);
  pb::GetRankAddressResponse response;
  Status s =
      rep_->Attempt("GetRankAddress", rep_->options.rpc_timeout, [&](grpc::ClientContext* context) {
        return rep_->stub->GetRankAddress(context, request, &response);
      });
  if (!s.ok()) return s;
  StatusOr<RankAddress> address = FromProto(response);
  if (!address.ok()) {
    return Status::Internal(absl::StrFormat("bootstrap %s answered GetRankAddress %s with %s",
                                            rep_->address, RankIdString(id),
                                            address.status().message()));
  }
  return address;
}

Status BootstrapClient::ReportRoomFailures(const std::vector<RoomFailure>& failures) {
  pb::ReportRoomFailuresRequest request;
  for (const RoomFailure& f : failures) {
    auto* out = request.add_failures();
    out->set_room(f.room);
    out->set_reason(f.reason.substr(0, kMaxRoomFailureReason));
  }
  pb::ReportRoomFailuresResponse response;
  return rep_->Attempt("ReportRoomFailures", rep_->options.rpc_timeout,
                       [&](grpc::ClientContext* context) {
                         return rep_->stub->ReportRoomFailures(context, request, &response);
                       });
}

StatusOr<std::vector<RoomFailure>> BootstrapClient::GetRoomFailures(
    const std::vector<uint64_t>& rooms) {
  pb::GetRoomFailuresRequest request;
  for (uint64_t room : rooms) request.add_rooms(room);
  pb::GetRoomFailuresResponse response;
  Status s = rep_->Attempt("GetRoomFailures", rep_->options.rpc_timeout,
                           [&](grpc::ClientContext* context) {
                             return rep_->stub->GetRoomFailures(context, request, &response);
                           });
  if (!s.ok()) return s;
  std::vector<RoomFailure> out;
  const absl::flat_hash_set<uint64_t> asked(rooms.begin(), rooms.end());
  for (const auto& f : response.failures()) {
    // Validated: only rooms this caller asked for, reasons bounded.
    if (!asked.contains(f.room())) continue;
    out.push_back({f.room(), f.reason().substr(0, kMaxRoomFailureReason)});
  }
  return out;
}

Status BootstrapClient::CheckHealth(std::string_view service) {
  health_pb::HealthCheckRequest request;
  request.set_service(std::string(service));
  health_pb::HealthCheckResponse response;
  Status s =
      rep_->Attempt("Health.Check", rep_->options.rpc_timeout, [&](grpc::ClientContext* context) {
        return rep_->health_stub->Check(context, request, &response);
      });
  if (!s.ok()) return s;
  if (response.status() != health_pb::HealthCheckResponse::SERVING) {
    return Status::Unavailable(
        absl::StrFormat("bootstrap %s reports service '%s' as %s", rep_->address, service,
                        health_pb::HealthCheckResponse::ServingStatus_Name(response.status())));
  }
  return Status::OK();
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
