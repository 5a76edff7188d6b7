// How EtcdClient makes a call (etcd_client.h): failover over endpoints, authentication tokens,
// cancellation, error messages, and the checks applied to what members send back.
#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lib/base/log_internal.h"
#include "lib/control/etcd_client.h"
#include "lib/control/etcd_client_internal.h"
#include "lib/control/grpc_status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace etcd_internal {

bool WaitConnected(grpc::Channel& channel, Clock::time_point deadline) {
  grpc_connectivity_state state = channel.GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!channel.WaitForStateChange(state, ToSystemDeadline(deadline))) return false;
    state = channel.GetState(/*try_to_connect=*/true);
  }
  return true;
}

std::chrono::system_clock::time_point ToSystemDeadline(Clock::time_point deadline) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - Clock::now());
}

std::string PrintableKey(std::string_view key) {
  constexpr size_t kMax = 64;
  const std::string_view head = key.substr(0, kMax);
  std::string out = absl::CHexEscape(absl::string_view(head.data(), head.size()));
  if (key.size() > kMax) out += absl::StrFormat("... (%d bytes)", key.size());
  return out;
}

KeyRange PrefixRange(std::string_view prefix) {
  if (prefix.empty()) return {std::string(1, '\0'), std::string(1, '\0')};
  return {std::string(prefix), EtcdPrefixRangeEnd(prefix)};
}

Status CheckKeyValue(const mvccpb::KeyValue& kv, const EtcdClientOptions& limits, bool deleted) {
  if (kv.key().empty()) return Status::Internal("a pair with an empty key");
  if (kv.key().size() > limits.max_key_bytes) {
    return Status::Internal(absl::StrFormat("key %s is %d bytes, over max_key_bytes %d",
                                            PrintableKey(kv.key()), kv.key().size(),
                                            limits.max_key_bytes));
  }
  if (kv.value().size() > limits.max_value_bytes) {
    return Status::Internal(absl::StrFormat("value of key %s is %d bytes, over max_value_bytes %d",
                                            PrintableKey(kv.key()), kv.value().size(),
                                            limits.max_value_bytes));
  }
  const bool revisions_ok =
      kv.mod_revision() > 0 && kv.lease() >= 0 &&
      (deleted ||
       (kv.create_revision() > 0 && kv.create_revision() <= kv.mod_revision() && kv.version() > 0));
  if (!revisions_ok) {
    return Status::Internal(absl::StrFormat(
        "key %s has inconsistent revisions (create %d, mod %d, version %d, lease %d)",
        PrintableKey(kv.key()), kv.create_revision(), kv.mod_revision(), kv.version(), kv.lease()));
  }
  return Status::OK();
}

EtcdKeyValue ToKeyValue(const mvccpb::KeyValue& kv) {
  return EtcdKeyValue{.key = kv.key(),
                      .value = kv.value(),
                      .create_revision = kv.create_revision(),
                      .mod_revision = kv.mod_revision(),
                      .version = kv.version(),
                      .lease = kv.lease()};
}

}  // namespace etcd_internal

using etcd_internal::Clock;
using etcd_internal::Endpoint;
using etcd_internal::ToSystemDeadline;
using std::chrono::milliseconds;
namespace pb = ::etcdserverpb;

namespace {

constexpr char kTokenKey[] = "token";    // etcd's metadata key for the auth token
constexpr size_t kMaxTokenBytes = 4096;  // simple tokens are ~25 bytes, JWTs a few hundred
constexpr milliseconds kMaxRoundPause{500};

bool Failover(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
}

}  // namespace

bool EtcdClient::Rep::Register(grpc::ClientContext* context) {
  MutexLock lock(&mu);
  if (cancelled) return false;
  in_flight.insert(context);
  return true;
}

void EtcdClient::Rep::Unregister(grpc::ClientContext* context) {
  MutexLock lock(&mu);
  in_flight.erase(context);
}

bool EtcdClient::Rep::Cancelled() {
  MutexLock lock(&mu);
  return cancelled;
}

Status EtcdClient::Rep::CancelledStatus(const char* method) const {
  return Status::Cancelled(absl::StrFormat("etcd client cancelled (%s)", method));
}

Status EtcdClient::Rep::Describe(const std::string& address, const char* method,
                                 milliseconds timeout, const Status& s) const {
  switch (s.code()) {
    case StatusCode::kOk: return s;
    case StatusCode::kUnavailable:
      return Status(s.code(),
                    absl::StrFormat("etcd %s unreachable (%s): %s", address, method, s.message()));
    case StatusCode::kDeadlineExceeded:
      return Status(s.code(),
                    absl::StrFormat("etcd %s did not answer %s within %d ms: %s", address, method,
                                    std::max<int64_t>(0, timeout.count()), s.message()));
    default:
      return Status(s.code(), absl::StrFormat("etcd %s: %s: %s", address, method, s.message()));
  }
}

Status EtcdClient::Rep::EnsureToken(Endpoint& ep, Clock::time_point deadline) {
  if (options.username.empty()) return Status::OK();
  {
    MutexLock lock(&ep.mu);
    if (!ep.token.empty()) return Status::OK();
  }
  pb::AuthenticateRequest request;
  request.set_name(options.username);
  request.set_password(options.password);
  pb::AuthenticateResponse response;
  grpc::ClientContext context;
  context.set_deadline(ToSystemDeadline(deadline));
  if (!Register(&context)) return CancelledStatus("Authenticate");
  Status s = FromGrpcStatus(ep.auth->Authenticate(&context, request, &response));
  Unregister(&context);
  if (s.ok()) {
    const std::string& token = response.token();
    const bool printable =
        std::all_of(token.begin(), token.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
    if (token.empty() || token.size() > kMaxTokenBytes || !printable) {
      s = Status::Internal(absl::StrFormat(
          "answered Authenticate with a token of %d bytes that is empty, over %d bytes or not "
          "printable",
          token.size(), kMaxTokenBytes));
    }
  }
  if (!s.ok()) {
    const auto timeout = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    return Describe(ep.address, "Authenticate", timeout, s);
  }
  MutexLock lock(&ep.mu);
  ep.token = response.token();
  return Status::OK();
}

void EtcdClient::Rep::AttachToken(Endpoint& ep, grpc::ClientContext* context) {
  if (options.username.empty()) return;
  MutexLock lock(&ep.mu);
  if (!ep.token.empty()) context->AddMetadata(kTokenKey, ep.token);
}

bool EtcdClient::Rep::ForgetTokenIfInvalid(Endpoint& ep, const Status& s) {
  // etcd: "etcdserver: invalid auth token" (UNAUTHENTICATED) once a simple token expired.
  if (options.username.empty() || s.code() != StatusCode::kUnauthenticated ||
      s.message().find("invalid auth token") == std::string_view::npos) {
    return false;
  }
  MutexLock lock(&ep.mu);
  ep.token.clear();
  return true;
}

Status EtcdClient::Rep::Attempt(Endpoint& ep, const char* method, Clock::time_point deadline,
                                const Rpc& rpc) {
  const Clock::time_point start = Clock::now();
  // An endpoint that is not connected gets dial_timeout to connect and answer; one that is
  // gets the whole call's deadline.
  Clock::time_point attempt_deadline = deadline;
  if (ep.channel->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    attempt_deadline = std::min(deadline, start + options.dial_timeout);
  }
  const auto timeout = std::chrono::duration_cast<milliseconds>(attempt_deadline - start);
  Status s;
  for (int tries = 0; tries < 2; ++tries) {  // a second time after re-authenticating
    if (s = EnsureToken(ep, attempt_deadline); !s.ok()) return s;
    grpc::ClientContext context;
    context.set_deadline(ToSystemDeadline(attempt_deadline));
    AttachToken(ep, &context);
    if (!Register(&context)) return CancelledStatus(method);
    s = rpc(ep, &context);
    Unregister(&context);
    if (s.ok() || !ForgetTokenIfInvalid(ep, s)) break;
  }
  if (s.code() == StatusCode::kCancelled && Cancelled()) return CancelledStatus(method);
  return Describe(ep.address, method, timeout, s);
}

bool EtcdClient::Rep::PauseWatchingChannels(Clock::time_point until) {
  constexpr milliseconds kSlice{50};
  size_t next = 0;
  while (Clock::now() < until) {
    if (Cancelled()) return false;
    const Clock::time_point slice = std::min(until, Clock::now() + kSlice);
    // A channel that is not connected, taking turns, to wait on: that wait polls its sockets.
    Endpoint* waiting = nullptr;
    grpc_connectivity_state state = GRPC_CHANNEL_READY;
    for (size_t i = 0; i < endpoints.size() && waiting == nullptr; ++i) {
      Endpoint& ep = *endpoints[(next + i) % endpoints.size()];
      state = ep.channel->GetState(/*try_to_connect=*/true);
      if (state != GRPC_CHANNEL_READY) waiting = &ep;
    }
    ++next;
    if (waiting != nullptr) {
      (void)waiting->channel->WaitForStateChange(state, ToSystemDeadline(slice));
      continue;
    }
    MutexLock lock(&mu);  // every channel is connected: a plain pause
    if (!cancelled) wake.WaitFor(&mu, slice - Clock::now());
  }
  return !Cancelled();
}

Status EtcdClient::Rep::Call(const char* method, Clock::time_point deadline, const Rpc& rpc) {
  const size_t n = endpoints.size();
  const size_t first = preferred.load(std::memory_order_relaxed) % n;
  std::vector<Status> last(n);  // each endpoint's last failure
  milliseconds pause{50};
  const Clock::time_point start = Clock::now();
  while (true) {
    for (size_t i = 0; i < n; ++i) {
      if (i > 0 && Clock::now() >= deadline) break;
      const size_t index = (first + i) % n;
      Status s = Attempt(*endpoints[index], method, deadline, rpc);
      if (s.ok()) {
        preferred.store(index, std::memory_order_relaxed);
        return s;
      }
      if (!Failover(s)) return s;
      PDLIB_LOG(kDebug, "%s; trying the next endpoint", s.message());
      last[index] = std::move(s);
    }
    // Every endpoint failed (a cluster electing a leader, or a member restarting): pause and go
    // round again while the deadline allows.
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    if (!PauseWatchingChannels(Clock::now() + std::min(pause, left))) {
      return CancelledStatus(method);
    }
    pause = std::min(pause * 2, kMaxRoundPause);
  }
  std::vector<std::string> messages;
  StatusCode code = StatusCode::kUnavailable;
  for (const Status& s : last) {
    if (s.ok()) continue;
    messages.emplace_back(s.message());
    code = s.code();
  }
  if (messages.size() == 1) return Status(code, messages.front());
  const auto elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return Status(code, absl::StrFormat("etcd: no endpoint answered %s within %d ms: %s", method,
                                      elapsed.count(), absl::StrJoin(messages, "; ")));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
