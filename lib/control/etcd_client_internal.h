// What etcd_call.cc, etcd_client.cc and etcd_watch.cc share: the client's state (one channel
// and set of stubs per endpoint, the cancellation registry), the call-with-failover loop, and
// the checks applied to what members send back. Not part of EtcdClient's interface.
#ifndef PDLIB_LIB_CONTROL_ETCD_CLIENT_INTERNAL_H_
#define PDLIB_LIB_CONTROL_ETCD_CLIENT_INTERNAL_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "lib/base/mutex.h"
#include "lib/control/etcd_client.h"
#include "lib/proto/etcd/rpc.grpc.pb.h"

namespace pdlib {
inline namespace v1 {
namespace control {
namespace etcd_internal {

namespace pb = ::etcdserverpb;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// One member: its channel, the stubs on it and the auth token it issued (etcd's default
// "simple" tokens are valid on the issuing member only).
struct Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KV::Stub> kv;
  std::unique_ptr<pb::Watch::Stub> watch;
  std::unique_ptr<pb::Lease::Stub> lease;
  std::unique_ptr<pb::Maintenance::Stub> maintenance;
  std::unique_ptr<pb::Auth::Stub> auth;

  Mutex mu;
  std::string token ABSL_GUARDED_BY(mu);  // empty: not authenticated (yet)
};

// Waits until `channel` is connected, starting a connection when idle; false at `deadline`.
//
// Why waits go through the channel: with gRPC's synchronous API, sockets are polled only by
// threads blocked in gRPC. A call on a channel in TRANSIENT_FAILURE fails at once without
// polling, so the reconnection gRPC starts after its backoff would otherwise complete only when
// its backup poller runs (every 5 s). A thread waiting for a state change polls meanwhile.
bool WaitConnected(grpc::Channel& channel, Clock::time_point deadline);

// grpc wants a system_clock deadline.
std::chrono::system_clock::time_point ToSystemDeadline(Clock::time_point deadline);

// A key for error messages: escaped, at most 64 bytes of it.
std::string PrintableKey(std::string_view key);

// The [key, range_end) of every key under `prefix`; "" is every key ("\0", "\0").
struct KeyRange {
  std::string key;
  std::string range_end;
};
KeyRange PrefixRange(std::string_view prefix);

// Checks a pair a member sent: key non-empty and under the limits, value under its limit,
// revisions consistent. A deleted key (watch DELETE event) carries its key and mod_revision only.
Status CheckKeyValue(const mvccpb::KeyValue& kv, const EtcdClientOptions& limits, bool deleted);
EtcdKeyValue ToKeyValue(const mvccpb::KeyValue& kv);

}  // namespace etcd_internal

struct EtcdClient::Rep {
  using Endpoint = etcd_internal::Endpoint;
  using Clock = etcd_internal::Clock;

  EtcdClientOptions options;
  std::vector<std::unique_ptr<Endpoint>> endpoints;
  std::vector<std::string> endpoint_names;  // endpoints[i]->address, for endpoints()
  // The endpoint the next call starts with. Relaxed: a hint, no data hangs on it.
  std::atomic<size_t> preferred{0};

  // Cancel() state. Watches keep their stop flag under this mutex too, and wait on `wake`, so
  // that one signal reaches every pause.
  Mutex mu;
  CondVar wake;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_set<grpc::ClientContext*> in_flight ABSL_GUARDED_BY(mu);

  Clock::time_point DeadlineFor(Duration timeout) const {
    return Clock::now() + (timeout.count() > 0 ? timeout : options.rpc_timeout);
  }

  // Registers a context so that Cancel() reaches it; false (not registered) when cancelled.
  bool Register(grpc::ClientContext* context) ABSL_LOCKS_EXCLUDED(mu);
  void Unregister(grpc::ClientContext* context) ABSL_LOCKS_EXCLUDED(mu);
  bool Cancelled() ABSL_LOCKS_EXCLUDED(mu);
  Status CancelledStatus(const char* method) const;

  // Authenticates on `ep` unless auth is off or it holds a token.
  Status EnsureToken(Endpoint& ep, Clock::time_point deadline) ABSL_LOCKS_EXCLUDED(mu);
  // Adds the endpoint's token (if any) to a call's metadata.
  void AttachToken(Endpoint& ep, grpc::ClientContext* context);
  // Drops the token when `s` says etcd no longer accepts it; true when it did.
  bool ForgetTokenIfInvalid(Endpoint& ep, const Status& s);

  // One attempt of `rpc(ep, context)` on one endpoint, until `deadline`. The error names the
  // endpoint and method.
  using Rpc = std::function<Status(Endpoint&, grpc::ClientContext*)>;
  Status Attempt(Endpoint& ep, const char* method, Clock::time_point deadline, const Rpc& rpc);
  // Sleeps until `until`, waiting on the channels that are not connected (WaitConnected says
  // why); false when cancelled.
  bool PauseWatchingChannels(Clock::time_point until) ABSL_LOCKS_EXCLUDED(mu);
  // Attempts on one endpoint after another (from the preferred one) while they are unreachable,
  // until `deadline`; errors other than UNAVAILABLE and DEADLINE_EXCEEDED return at once.
  Status Call(const char* method, Clock::time_point deadline, const Rpc& rpc);

  Status Describe(const std::string& address, const char* method, std::chrono::milliseconds timeout,
                  const Status& s) const;

  // Every pair in [range.key, range.range_end), at one revision.
  StatusOr<EtcdRange> RangeOf(const etcd_internal::KeyRange& range, Clock::time_point deadline);
  // DeleteRange of [range.key, range.range_end): the number of keys deleted.
  StatusOr<int64_t> DeleteRange(const etcd_internal::KeyRange& range, Clock::time_point deadline);
  // A Txn comparing the key's mod_revision with `expected`: `op` on success, a Range of the key
  // on failure (so that the caller learns what is there).
  StatusOr<EtcdTxnResult> CompareAndSwap(const char* method, std::string_view key, int64_t expected,
                                         etcd_internal::pb::RequestOp op,
                                         Clock::time_point deadline);
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_ETCD_CLIENT_INTERNAL_H_
