#include "lib/control/etcd_client.h"

#include <algorithm>
#include <charconv>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lib/control/etcd_client_internal.h"
#include "lib/control/grpc_status.h"
#include "lib/control/security.h"

namespace pdlib {
inline namespace v1 {
namespace control {

using etcd_internal::CheckKeyValue;
using etcd_internal::Clock;
using etcd_internal::Endpoint;
using etcd_internal::KeyRange;
using etcd_internal::PrefixRange;
using etcd_internal::PrintableKey;
using etcd_internal::ToKeyValue;
using std::chrono::milliseconds;
namespace pb = ::etcdserverpb;

namespace {

Status ValidateOptions(const EtcdClientOptions& o) {
  if (o.endpoints.empty()) return Status::InvalidArgument("etcd client: no endpoints");
  for (const std::string& e : o.endpoints) {
    if (e.find("://") != std::string::npos) {
      return Status::InvalidArgument(
          absl::StrFormat("etcd endpoint '%s': give host:port, without a scheme (TLS comes from "
                          "the tls_* options)",
                          e));
    }
    const size_t colon = e.rfind(':');
    int port = 0;
    const char* end = e.data() + e.size();
    const bool port_ok = colon != std::string::npos && colon + 1 < e.size() &&
                         std::from_chars(e.data() + colon + 1, end, port).ptr == end && port > 0 &&
                         port <= 65535;
    if (colon == 0 || !port_ok) {
      return Status::InvalidArgument(
          absl::StrFormat("etcd endpoint '%s' is not host:port with a port in [1, 65535]", e));
    }
  }
  if (o.dial_timeout.count() <= 0 || o.rpc_timeout.count() <= 0) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd client dial_timeout %d ms and rpc_timeout %d ms must be positive",
                        o.dial_timeout.count(), o.rpc_timeout.count()));
  }
  if (o.max_key_bytes == 0 || o.max_value_bytes == 0 || o.max_range_keys == 0 ||
      o.max_response_bytes == 0 || o.max_response_bytes > size_t{INT32_MAX}) {
    return Status::InvalidArgument(
        "etcd client limits must be positive (max_response_bytes at most 2^31 - 1)");
  }
  if (o.username.empty() && !o.password.empty()) {
    return Status::InvalidArgument("etcd client: a password without a username");
  }
  return Status::OK();
}

Status CheckKey(std::string_view key, const EtcdClientOptions& o, const char* what = "key") {
  if (key.empty()) return Status::InvalidArgument(absl::StrFormat("etcd %s is empty", what));
  if (key.size() > o.max_key_bytes) {
    return Status::InvalidArgument(absl::StrFormat("etcd %s %s is %d bytes, over max_key_bytes %d",
                                                   what, PrintableKey(key), key.size(),
                                                   o.max_key_bytes));
  }
  return Status::OK();
}

Status CheckPut(std::string_view key, std::string_view value, int64_t lease,
                const EtcdClientOptions& o) {
  if (Status s = CheckKey(key, o); !s.ok()) return s;
  if (value.size() > o.max_value_bytes) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd value for key %s is %d bytes, over max_value_bytes %d",
                        PrintableKey(key), value.size(), o.max_value_bytes));
  }
  if (lease < 0) {
    return Status::InvalidArgument(absl::StrFormat("etcd lease id %d is negative", lease));
  }
  return Status::OK();
}

// The pairs of a Range answer, checked: at most `max_keys`, each in [key, range_end).
Status TakeRange(const pb::RangeResponse& r, const KeyRange& range, bool single_key,
                 const EtcdClientOptions& o, std::vector<EtcdKeyValue>* out) {
  if (r.more() || static_cast<size_t>(r.kvs_size()) > o.max_range_keys) {
    return Status::ResourceExhausted(
        absl::StrFormat("range at %s holds more than max_range_keys %d keys",
                        PrintableKey(range.key), o.max_range_keys));
  }
  out->clear();
  out->reserve(r.kvs_size());
  for (const mvccpb::KeyValue& kv : r.kvs()) {
    if (Status s = CheckKeyValue(kv, o, /*deleted=*/false); !s.ok()) return s;
    const bool inside =
        single_key ? kv.key() == range.key
                   : kv.key() >= range.key && (range.range_end == std::string_view("\0", 1) ||
                                               kv.key() < range.range_end);
    if (!inside) {
      return Status::Internal(absl::StrFormat("answered a range at %s with key %s outside it",
                                              PrintableKey(range.key), PrintableKey(kv.key())));
    }
    out->push_back(ToKeyValue(kv));
  }
  return Status::OK();
}

}  // namespace

std::string EtcdPrefixRangeEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

// --- EtcdClient ---

StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(const EtcdClientOptions& options) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;
  ControlSecurity security;
  security.tls_ca_file = options.tls_ca_file;
  security.tls_cert_file = options.tls_cert_file;
  security.tls_key_file = options.tls_key_file;
  if (Status s = ValidateSecurity(security); !s.ok()) return s.WithPrefix("etcd client");
  auto creds = MakeChannelCredentials(security);
  if (!creds.ok()) return creds.status().WithPrefix("etcd client");

  auto rep = std::make_shared<Rep>();
  rep->options = options;
  grpc::ChannelArguments args;
  // Reconnect quickly after a member restarts (gRPC's defaults wait 1 s growing to 120 s), with
  // this client's own backoff rather than one shared process-wide.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, static_cast<int>(options.max_response_bytes));
  // Pings find a member that stopped answering under a quiet watch stream. etcd refuses pings
  // more often than every 5 s (--grpc-keepalive-min-time) and without an open call.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  for (const std::string& address : options.endpoints) {
    auto ep = std::make_unique<Endpoint>();
    ep->address = address;
    ep->channel = grpc::CreateCustomChannel(address, *creds, args);
    ep->kv = pb::KV::NewStub(ep->channel);
    ep->watch = pb::Watch::NewStub(ep->channel);
    ep->lease = pb::Lease::NewStub(ep->channel);
    ep->maintenance = pb::Maintenance::NewStub(ep->channel);
    ep->auth = pb::Auth::NewStub(ep->channel);
    rep->endpoints.push_back(std::move(ep));
    rep->endpoint_names.push_back(address);
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(rep)));
}

EtcdClient::EtcdClient(std::shared_ptr<Rep> rep) : rep_(std::move(rep)) {}

EtcdClient::~EtcdClient() = default;

const std::vector<std::string>& EtcdClient::endpoints() const { return rep_->endpoint_names; }

std::string EtcdClient::preferred_endpoint() const {
  return rep_->endpoint_names[rep_->preferred.load(std::memory_order_relaxed) %
                              rep_->endpoint_names.size()];
}

void EtcdClient::Cancel() {
  MutexLock lock(&rep_->mu);
  rep_->cancelled = true;
  for (grpc::ClientContext* context : rep_->in_flight) context->TryCancel();
  rep_->wake.SignalAll();
}

StatusOr<int64_t> EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease_id,
                                  Duration timeout) {
  if (Status s = CheckPut(key, value, lease_id, rep_->options); !s.ok()) return s;
  pb::PutRequest request;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  request.set_lease(lease_id);
  int64_t revision = 0;
  Status s = rep_->Call("Put", rep_->DeadlineFor(timeout),
                        [&](Endpoint& ep, grpc::ClientContext* context) {
                          pb::PutResponse response;
                          Status st = FromGrpcStatus(ep.kv->Put(context, request, &response));
                          revision = response.header().revision();
                          return st;
                        });
  if (!s.ok()) return s;
  return revision;
}

StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(std::string_view key, Duration timeout) {
  if (Status s = CheckKey(key, rep_->options); !s.ok()) return s;
  pb::RangeRequest request;
  request.set_key(std::string(key));
  const KeyRange range{std::string(key), ""};
  std::vector<EtcdKeyValue> kvs;
  Status s = rep_->Call(
      "Range", rep_->DeadlineFor(timeout), [&](Endpoint& ep, grpc::ClientContext* context) {
        pb::RangeResponse response;
        Status st = FromGrpcStatus(ep.kv->Range(context, request, &response));
        if (!st.ok()) return st;
        return TakeRange(response, range, /*single_key=*/true, rep_->options, &kvs);
      });
  if (!s.ok()) return s;
  if (kvs.empty()) return std::optional<EtcdKeyValue>();
  return std::optional<EtcdKeyValue>(std::move(kvs.front()));
}

StatusOr<EtcdRange> EtcdClient::GetPrefix(std::string_view prefix, Duration timeout) {
  if (prefix.size() > rep_->options.max_key_bytes) return CheckKey(prefix, rep_->options, "prefix");
  return rep_->RangeOf(PrefixRange(prefix), rep_->DeadlineFor(timeout));
}

StatusOr<EtcdRange> EtcdClient::Rep::RangeOf(const KeyRange& range, Clock::time_point deadline) {
  pb::RangeRequest request;
  request.set_key(range.key);
  request.set_range_end(range.range_end);
  // A range holding more keys than we accept shows as `more`, without the server sending them.
  request.set_limit(static_cast<int64_t>(options.max_range_keys));
  EtcdRange result;
  Status s = Call("Range", deadline, [&](Endpoint& ep, grpc::ClientContext* context) {
    pb::RangeResponse response;
    Status st = FromGrpcStatus(ep.kv->Range(context, request, &response));
    if (!st.ok()) return st;
    result.revision = response.header().revision();
    return TakeRange(response, range, /*single_key=*/false, options, &result.kvs);
  });
  if (!s.ok()) return s;
  return result;
}

StatusOr<int64_t> EtcdClient::Rep::DeleteRange(const KeyRange& range, Clock::time_point deadline) {
  pb::DeleteRangeRequest request;
  request.set_key(range.key);
  request.set_range_end(range.range_end);
  int64_t deleted = 0;
  Status s = Call("DeleteRange", deadline, [&](Endpoint& ep, grpc::ClientContext* context) {
    pb::DeleteRangeResponse response;
    Status st = FromGrpcStatus(ep.kv->DeleteRange(context, request, &response));
    if (st.ok() && response.deleted() < 0) {
      return Status::Internal(
          absl::StrFormat("answered DeleteRange with %d keys deleted", response.deleted()));
    }
    deleted = response.deleted();
    return st;
  });
  if (!s.ok()) return s;
  return deleted;
}

StatusOr<EtcdTxnResult> EtcdClient::Rep::CompareAndSwap(const char* method, std::string_view key,
                                                        int64_t expected, pb::RequestOp op,
                                                        Clock::time_point deadline) {
  if (expected < 0) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd %s: expected mod_revision %d is negative", method, expected));
  }
  pb::TxnRequest request;
  pb::Compare* compare = request.add_compare();
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(pb::Compare::MOD);
  compare->set_key(std::string(key));
  compare->set_mod_revision(expected);
  *request.add_success() = std::move(op);
  request.add_failure()->mutable_request_range()->set_key(std::string(key));
  const KeyRange range{std::string(key), ""};

  EtcdTxnResult result;
  Status s = Call("Txn", deadline, [&](Endpoint& ep, grpc::ClientContext* context) {
    pb::TxnResponse response;
    Status st = FromGrpcStatus(ep.kv->Txn(context, request, &response));
    if (!st.ok()) return st;
    result = EtcdTxnResult{};
    result.succeeded = response.succeeded();
    result.revision = response.header().revision();
    if (response.responses_size() != 1) {
      return Status::Internal(
          absl::StrFormat("answered a Txn of one operation with %d", response.responses_size()));
    }
    if (result.succeeded) return Status::OK();
    const pb::ResponseOp& r = response.responses(0);
    if (!r.has_response_range()) {
      return Status::Internal("answered a failed Txn without the failure branch's Range");
    }
    std::vector<EtcdKeyValue> kvs;
    if (st = TakeRange(r.response_range(), range, /*single_key=*/true, options, &kvs); !st.ok()) {
      return st;
    }
    if (!kvs.empty()) result.current = std::move(kvs.front());
    return Status::OK();
  });
  if (!s.ok()) return s;
  return result;
}

StatusOr<int64_t> EtcdClient::Delete(std::string_view key, Duration timeout) {
  if (Status s = CheckKey(key, rep_->options); !s.ok()) return s;
  return rep_->DeleteRange(KeyRange{std::string(key), ""}, rep_->DeadlineFor(timeout));
}

StatusOr<int64_t> EtcdClient::DeletePrefix(std::string_view prefix, Duration timeout) {
  if (prefix.size() > rep_->options.max_key_bytes) return CheckKey(prefix, rep_->options, "prefix");
  return rep_->DeleteRange(PrefixRange(prefix), rep_->DeadlineFor(timeout));
}

StatusOr<EtcdTxnResult> EtcdClient::PutIf(std::string_view key, std::string_view value,
                                          int64_t lease_id, int64_t expected_mod_revision,
                                          Duration timeout) {
  if (Status s = CheckPut(key, value, lease_id, rep_->options); !s.ok()) return s;
  pb::RequestOp op;
  pb::PutRequest* put = op.mutable_request_put();
  put->set_key(std::string(key));
  put->set_value(std::string(value));
  put->set_lease(lease_id);
  return rep_->CompareAndSwap("PutIf", key, expected_mod_revision, std::move(op),
                              rep_->DeadlineFor(timeout));
}

StatusOr<EtcdTxnResult> EtcdClient::DeleteIf(std::string_view key, int64_t expected_mod_revision,
                                             Duration timeout) {
  if (Status s = CheckKey(key, rep_->options); !s.ok()) return s;
  pb::RequestOp op;
  op.mutable_request_delete_range()->set_key(std::string(key));
  return rep_->CompareAndSwap("DeleteIf", key, expected_mod_revision, std::move(op),
                              rep_->DeadlineFor(timeout));
}

StatusOr<EtcdLease> EtcdClient::GrantLease(int64_t ttl_seconds, Duration timeout) {
  if (ttl_seconds <= 0) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd lease TTL %d s must be positive", ttl_seconds));
  }
  pb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  EtcdLease lease;
  Status s = rep_->Call(
      "LeaseGrant", rep_->DeadlineFor(timeout), [&](Endpoint& ep, grpc::ClientContext* context) {
        pb::LeaseGrantResponse response;
        Status st = FromGrpcStatus(ep.lease->LeaseGrant(context, request, &response));
        if (!st.ok()) return st;
        if (!response.error().empty()) {
          return Status::Unknown(response.error().substr(0, 256));
        }
        if (response.id() <= 0 || response.ttl() <= 0) {
          return Status::Internal(absl::StrFormat("answered LeaseGrant with lease %d, TTL %d s",
                                                  response.id(), response.ttl()));
        }
        lease = EtcdLease{.id = response.id(), .ttl_seconds = response.ttl()};
        return Status::OK();
      });
  if (!s.ok()) return s;
  return lease;
}

Status EtcdClient::RevokeLease(int64_t lease_id, Duration timeout) {
  pb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  return rep_->Call("LeaseRevoke", rep_->DeadlineFor(timeout),
                    [&](Endpoint& ep, grpc::ClientContext* context) {
                      pb::LeaseRevokeResponse response;
                      return FromGrpcStatus(ep.lease->LeaseRevoke(context, request, &response));
                    });
}

StatusOr<int64_t> EtcdClient::KeepAliveOnce(int64_t lease_id, Duration timeout) {
  pb::LeaseKeepAliveRequest request;
  request.set_id(lease_id);
  int64_t ttl = 0;
  Status s = rep_->Call(
      "LeaseKeepAlive", rep_->DeadlineFor(timeout),
      [&](Endpoint& ep, grpc::ClientContext* context) {
        auto stream = ep.lease->LeaseKeepAlive(context);
        pb::LeaseKeepAliveResponse response;
        if (!stream->Write(request) || !stream->Read(&response)) {
          return FromGrpcStatus(stream->Finish());
        }
        // One answer is all this call wants: end the stream rather than wait for the server
        // to close it.
        context->TryCancel();
        (void)stream->Finish();
        if (response.id() != lease_id) {
          return Status::Internal(absl::StrFormat("answered a keep-alive of lease %d for lease %d",
                                                  lease_id, response.id()));
        }
        ttl = response.ttl();
        return Status::OK();
      });
  if (!s.ok()) return s;
  if (ttl <= 0) {
    return Status::NotFound(absl::StrFormat("etcd lease %d expired or does not exist", lease_id));
  }
  return ttl;
}

StatusOr<int64_t> EtcdClient::LeaseTimeToLive(int64_t lease_id, Duration timeout) {
  pb::LeaseTimeToLiveRequest request;
  request.set_id(lease_id);
  int64_t ttl = 0;
  Status s = rep_->Call(
      "LeaseTimeToLive", rep_->DeadlineFor(timeout),
      [&](Endpoint& ep, grpc::ClientContext* context) {
        pb::LeaseTimeToLiveResponse response;
        Status st = FromGrpcStatus(ep.lease->LeaseTimeToLive(context, request, &response));
        ttl = response.ttl();
        return st;
      });
  if (!s.ok()) return s;
  if (ttl < 0) {
    return Status::NotFound(absl::StrFormat("etcd lease %d expired or does not exist", lease_id));
  }
  return ttl;
}

StatusOr<EtcdMemberStatus> EtcdClient::MemberStatus(std::string_view endpoint, Duration timeout) {
  auto it = std::find(rep_->endpoint_names.begin(), rep_->endpoint_names.end(), endpoint);
  if (it == rep_->endpoint_names.end()) {
    return Status::InvalidArgument(
        absl::StrFormat("etcd endpoint '%s' is not one of this client's (%s)", endpoint,
                        absl::StrJoin(rep_->endpoint_names, ", ")));
  }
  Endpoint& ep = *rep_->endpoints[it - rep_->endpoint_names.begin()];
  const Clock::time_point deadline = rep_->DeadlineFor(timeout);
  // No other endpoint to move on to: wait for a connection (a failed call would not).
  const Clock::time_point start = Clock::now();
  const Clock::time_point dial_deadline = std::min(deadline, start + rep_->options.dial_timeout);
  if (!etcd_internal::WaitConnected(*ep.channel, dial_deadline)) {
    return Status::Unavailable(
        absl::StrFormat("etcd %s unreachable (Status): not connected within %d ms", ep.address,
                        std::chrono::duration_cast<milliseconds>(dial_deadline - start).count()));
  }
  pb::StatusRequest request;
  pb::StatusResponse response;
  Status s = rep_->Attempt(ep, "Status", deadline, [&](Endpoint& e, grpc::ClientContext* context) {
    return FromGrpcStatus(e.maintenance->Status(context, request, &response));
  });
  if (!s.ok()) return s;
  EtcdMemberStatus status{.endpoint = ep.address,
                          .version = response.version().substr(0, 64),
                          .member_id = response.header().member_id(),
                          .leader = response.leader(),
                          .raft_term = response.raftterm(),
                          .revision = response.header().revision(),
                          .db_size = response.dbsize(),
                          .errors = {}};
  for (int i = 0; i < std::min(response.errors_size(), 16); ++i) {
    status.errors.push_back(response.errors(i).substr(0, 256));
  }
  return status;
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
