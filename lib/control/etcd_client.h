// EtcdClient: a small client of etcd's v3 gRPC API (issue #18), for the etcd discovery backend.
//
// It speaks etcd's own protocol (lib/proto/etcd/*.proto, written for pdlib and wire-compatible
// with etcd's), over one gRPC channel per endpoint. A call starts at the endpoint that last
// answered; when an endpoint cannot be reached (UNAVAILABLE, or no connection within
// dial_timeout) it tries the next, round after round, until the call's deadline. (A member that
// holds connections open but does not answer, e.g. a stopped process, holds a call until its
// deadline; keepalive pings drop such a connection within 15 s.) Errors keep the
// gRPC code and name the endpoint and etcd's message ("etcd 127.0.0.1:2379: Put: etcdserver:
// requested lease not found"). Everything a server sends back is checked against the limits of
// the options before it is used: a bad answer is an error, never a crash.
//
// With a username, the client authenticates on each endpoint before its first call there (etcd's
// default tokens are valid on the member that issued them only) and again when etcd reports the
// token invalid (expired). With TLS files, every channel uses TLS.
//
// Thread-safe: any thread may call any method, concurrently. Cancel() makes every running and
// later call, and every watch, end with CANCELLED promptly (for shutdown). Including this
// header does not pull in gRPC or protobuf headers.
#ifndef PDLIB_LIB_CONTROL_ETCD_CLIENT_H_
#define PDLIB_LIB_CONTROL_ETCD_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

struct EtcdClientOptions {
  // "host:port" of every member the client may use ("127.0.0.1:2379", "[::1]:2379").
  std::vector<std::string> endpoints;
  // How long one attempt waits for a connection to an endpoint before moving to the next.
  std::chrono::milliseconds dial_timeout{1000};
  // Deadline of a call over every endpoint it tries, unless the call names its own.
  std::chrono::milliseconds rpc_timeout{5000};
  // etcd authentication; empty username: none.
  std::string username;
  std::string password;
  // TLS: tls_ca_file verifies the members' certificates; tls_cert_file and tls_key_file (both
  // or neither) are presented to members that ask for a client certificate. All empty: no TLS.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Limits on what a member may send back. etcd itself refuses requests over 1.5 MiB by default.
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{1} << 20;
  size_t max_range_keys = 100000;                // pairs in one GetPrefix answer
  size_t max_response_bytes = size_t{64} << 20;  // one gRPC message
};

// One key as etcd stores it. Revisions are those of the whole store (etcd's MVCC revision).
struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;  // revision that created the key
  int64_t mod_revision = 0;     // revision of its last change
  int64_t version = 0;          // changes since creation (1 after the first put)
  int64_t lease = 0;            // 0: no lease
};

struct EtcdRange {
  std::vector<EtcdKeyValue> kvs;  // in key order
  int64_t revision = 0;           // the store's revision the answer reflects
};

// The outcome of a compare-and-swap (PutIf, PutIfAbsent, DeleteIf).
struct EtcdTxnResult {
  bool succeeded = false;
  int64_t revision = 0;  // the store's revision after the transaction
  // When it did not succeed: the key as it is now (nullopt: absent).
  std::optional<EtcdKeyValue> current;
};

struct EtcdLease {
  int64_t id = 0;
  int64_t ttl_seconds = 0;  // as granted; etcd may raise a small TTL to its minimum
};

struct EtcdMemberStatus {
  std::string endpoint;
  std::string version;  // etcd's version, e.g. "3.4.23"
  uint64_t member_id = 0;
  uint64_t leader = 0;  // the member this one follows; 0: it knows no leader
  uint64_t raft_term = 0;
  int64_t revision = 0;
  int64_t db_size = 0;
  std::vector<std::string> errors;  // alarms the member reports
};

struct EtcdWatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  // kPut: the key as written. kDelete: key and mod_revision (the revision of the deletion) only.
  EtcdKeyValue kv;
  std::optional<EtcdKeyValue> prev_kv;  // with EtcdWatchOptions::prev_kv, when etcd still had it
};

// What one callback of a watch delivers.
struct EtcdWatchUpdate {
  // True when the watch could not resume where it stopped because etcd compacted that history:
  // `snapshot` then holds the whole prefix as of `revision`, replacing whatever the user built
  // from earlier updates, and the watch goes on from revision + 1. `events` is empty then.
  bool resynced = false;
  std::vector<EtcdKeyValue> snapshot;
  // Changes under the prefix, in revision order (several may share one revision: a Txn).
  std::vector<EtcdWatchEvent> events;
  // Everything up to this revision has been delivered.
  int64_t revision = 0;
};

struct EtcdWatchOptions {
  // First revision to deliver (inclusive); 0: changes after the watch is created. Typically
  // GetPrefix's revision + 1.
  int64_t start_revision = 0;
  bool prev_kv = false;
  // Pause before reconnecting after the stream broke; doubles up to max_backoff.
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{1000};
};

// Watches one key prefix on its own thread (EtcdClient::WatchPrefix), calling the callback with
// each batch of changes in order. When the stream breaks (the member died, was partitioned from
// its cluster's leader, or the connection dropped) it reconnects, trying the next endpoint, and
// resumes from the revision after the last one delivered, so no change is lost or repeated.
//
// Threads: the callback runs on the watch's thread, one update at a time, and may stop or even
// destroy the watch (the thread then ends once the callback returns). Stop() and the accessors
// may be called from any thread. The watch keeps what it needs of its client alive, so either
// may be destroyed first; EtcdClient::Cancel() ends it too.
class EtcdWatch {
 public:
  using Callback = std::function<void(const EtcdWatchUpdate&)>;

  EtcdWatch(const EtcdWatch&) = delete;
  EtcdWatch& operator=(const EtcdWatch&) = delete;
  ~EtcdWatch();  // Stop()

  // Ends the stream (at once, through gRPC's cancellation) and joins the thread, unless called
  // from the callback. No callback starts after it returns (elsewhere). Idempotent.
  void Stop();

  // The last revision delivered (0 before the first update).
  int64_t revision() const;
  // The endpoint of the current stream, "" between streams.
  std::string endpoint() const;
  // Streams created so far; the first is 1 (tests check reconnections with it).
  int64_t streams_created() const;
  // Why the last stream ended, until etcd accepts the watch again (then OK): for health checks
  // and logs. A watch keeps retrying whatever the error (etcd down, permission denied).
  Status last_error() const;

 private:
  friend class EtcdClient;
  struct Rep;
  explicit EtcdWatch(std::shared_ptr<Rep> rep);
  std::shared_ptr<Rep> rep_;
};

class EtcdClient {
 public:
  using Duration = std::chrono::milliseconds;
  // A call's deadline: options.rpc_timeout unless it names one.
  static constexpr Duration kDefaultTimeout{0};

  // Validates the options (endpoints, limits, TLS files). Connects lazily: succeeds while every
  // member is down.
  static StatusOr<std::unique_ptr<EtcdClient>> Create(const EtcdClientOptions& options);

  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;
  // Must not run while a call is running on another thread (Cancel() and join first).
  ~EtcdClient();

  // --- Keys ---
  // Writes key = value (attached to lease `lease_id` unless 0); the store's new revision.
  StatusOr<int64_t> Put(std::string_view key, std::string_view value, int64_t lease_id = 0,
                        Duration timeout = kDefaultTimeout);
  // The key, or nullopt when absent.
  StatusOr<std::optional<EtcdKeyValue>> Get(std::string_view key,
                                            Duration timeout = kDefaultTimeout);
  // Every key starting with `prefix` ("" is every key), at one revision.
  StatusOr<EtcdRange> GetPrefix(std::string_view prefix, Duration timeout = kDefaultTimeout);
  // The number of keys deleted (0 or 1).
  StatusOr<int64_t> Delete(std::string_view key, Duration timeout = kDefaultTimeout);
  // Every key starting with `prefix`; "" deletes every key.
  StatusOr<int64_t> DeletePrefix(std::string_view prefix, Duration timeout = kDefaultTimeout);

  // --- Compare-and-swap (one Txn each) ---
  // Writes key = value if the key's mod_revision is `expected_mod_revision` (0: the key must be
  // absent). Caveat of every failover: if a member applied the write but its answer was lost
  // (UNAVAILABLE mid-call), the retry on the next member finds the key changed and reports
  // !succeeded with `current` holding this very write.
  StatusOr<EtcdTxnResult> PutIf(std::string_view key, std::string_view value, int64_t lease_id,
                                int64_t expected_mod_revision, Duration timeout = kDefaultTimeout);
  StatusOr<EtcdTxnResult> PutIfAbsent(std::string_view key, std::string_view value,
                                      int64_t lease_id, Duration timeout = kDefaultTimeout) {
    return PutIf(key, value, lease_id, 0, timeout);
  }
  // Deletes the key if its mod_revision is `expected_mod_revision`.
  StatusOr<EtcdTxnResult> DeleteIf(std::string_view key, int64_t expected_mod_revision,
                                   Duration timeout = kDefaultTimeout);

  // --- Leases ---
  StatusOr<EtcdLease> GrantLease(int64_t ttl_seconds, Duration timeout = kDefaultTimeout);
  // Ends the lease at once, deleting its keys. NOT_FOUND when it had expired.
  Status RevokeLease(int64_t lease_id, Duration timeout = kDefaultTimeout);
  // Renews the lease once (one LeaseKeepAlive stream, one request, one answer); the renewed
  // TTL in seconds. NOT_FOUND when the lease expired or never existed. The caller runs its own
  // loop, typically every ttl / 3.
  StatusOr<int64_t> KeepAliveOnce(int64_t lease_id, Duration timeout = kDefaultTimeout);
  // Seconds the lease has left; NOT_FOUND when it expired or never existed.
  StatusOr<int64_t> LeaseTimeToLive(int64_t lease_id, Duration timeout = kDefaultTimeout);

  // --- Watch ---
  // Starts watching every key under `prefix` (see EtcdWatch). Fails only on bad arguments or a
  // cancelled client: the watch connects (and reconnects) on its own thread.
  StatusOr<std::unique_ptr<EtcdWatch>> WatchPrefix(std::string_view prefix,
                                                   const EtcdWatchOptions& options,
                                                   EtcdWatch::Callback callback);

  // --- Health ---
  // Maintenance.Status of one member (one of options.endpoints), without failover.
  StatusOr<EtcdMemberStatus> MemberStatus(std::string_view endpoint,
                                          Duration timeout = kDefaultTimeout);

  // Makes running and later calls and watches end with CANCELLED. Irreversible.
  void Cancel();

  const std::vector<std::string>& endpoints() const;
  // The endpoint the next call starts with: the one that last answered.
  std::string preferred_endpoint() const;

 private:
  friend class EtcdWatch;  // a watch shares the client's channels and Cancel()
  struct Rep;
  explicit EtcdClient(std::shared_ptr<Rep> rep);
  std::shared_ptr<Rep> rep_;
};

// The range_end that makes [prefix, range_end) every key starting with `prefix`: the prefix
// with its last byte below 0xff incremented and what follows dropped; "\0" (every key >= prefix)
// when it has no such byte or is empty.
std::string EtcdPrefixRangeEnd(std::string_view prefix);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_ETCD_CLIENT_H_
