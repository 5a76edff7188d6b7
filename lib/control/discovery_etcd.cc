// Discovery through etcd (discovery.h). A prefill rank's registration is the bootstrap wire
// message (RegisterRankRequest, serialised) stored at its rank key with a lease; decode reads a
// deployment's keys at one revision and applies the bootstrap server's own rules to them
// (BootstrapTable, in the order the keys were created), so both discoveries accept and refuse
// the same deployments. Anything under the prefix that is not a valid registration is refused
// with a reason (logged) and never used.
#include "lib/control/discovery_etcd.h"

#include <algorithm>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/control/bootstrap_table.h"
#include "lib/control/etcd_client.h"
#include "lib/control/net_address.h"
#include "lib/control/proto_convert.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A registration as stored in etcd.
std::string EncodeRegistration(const RankRegistration& reg) {
  wire::v1::RegisterRankRequest msg;
  ToProto(reg, &msg);
  return msg.SerializeAsString();
}

// The registration stored at `kv`, checked against its key; INVALID_ARGUMENT naming the key.
StatusOr<RankRegistration> DecodeRegistration(std::string_view prefix, const EtcdKeyValue& kv) {
  auto parts = ParseEtcdRankKey(prefix, kv.key);
  if (!parts.ok()) return parts.status();
  wire::v1::RegisterRankRequest msg;
  if (!msg.ParseFromString(kv.value)) {
    return Status::InvalidArgument(absl::StrFormat(
        "etcd key %s: value (%d bytes) is not a pdlib rank registration", kv.key, kv.value.size()));
  }
  auto reg = FromProto(msg);
  if (!reg.ok()) return reg.status().WithPrefix("etcd key " + kv.key);
  if (Status s = ValidateRankRegistration(*reg); !s.ok()) return s.WithPrefix("etcd key " + kv.key);
  if (!(reg->rank_id() == parts->rank)) {
    return Status::InvalidArgument(absl::StrFormat("etcd key %s holds the registration of rank %s",
                                                   kv.key, RankIdString(reg->rank_id())));
  }
  return reg;
}

// The deployment's table as the keys read at one revision make it.
struct Snapshot {
  std::unique_ptr<BootstrapTable> table = std::make_unique<BootstrapTable>();
  absl::flat_hash_map<RankId, int64_t> mod_revision;  // the registration's id for decode
  std::vector<std::string> refused;                   // reasons, for messages
};

Snapshot BuildSnapshot(std::string_view prefix, std::vector<EtcdKeyValue> kvs) {
  // The first rank to register fixes the layout, as on a bootstrap server.
  std::stable_sort(kvs.begin(), kvs.end(), [](const EtcdKeyValue& a, const EtcdKeyValue& b) {
    return a.create_revision < b.create_revision;
  });
  Snapshot snap;
  for (const EtcdKeyValue& kv : kvs) {
    auto reg = DecodeRegistration(prefix, kv);
    Status s = reg.status();
    if (reg.ok()) s = snap.table->Register(*reg).status();
    if (!s.ok()) {
      snap.refused.emplace_back(s.message());
      continue;
    }
    snap.mod_revision[reg->rank_id()] = kv.mod_revision;
  }
  return snap;
}

EtcdClientOptions ClientOptions(const KVManagerOptions& o) {
  EtcdClientOptions eo;
  eo.endpoints = o.etcd_endpoints;
  eo.dial_timeout = std::min<milliseconds>(o.connect_timeout, milliseconds(1000));
  eo.rpc_timeout = o.connect_timeout;
  eo.username = o.etcd_username;
  eo.password = o.etcd_password;
  eo.tls_ca_file = o.etcd_tls_ca_file;
  eo.tls_cert_file = o.etcd_tls_cert_file;
  eo.tls_key_file = o.etcd_tls_key_file;
  return eo;
}

// etcd answers some passing conditions (a leader election under way, a proposal that timed out
// inside the cluster: "context deadline exceeded", "leader changed") with UNKNOWN; like
// UNAVAILABLE they may succeed on the next try, so they are reported as UNAVAILABLE, which every
// caller retries within its own bound.
Status Transient(const Status& s) {
  return s.code() == StatusCode::kUnknown ? Status::Unavailable(s.message()) : s;
}

bool MaySucceedLater(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded ||
         s.code() == StatusCode::kUnknown;
}

// ---------------------------------------------------------------------------------------------

class EtcdDirectory final : public DeploymentDirectory {
 public:
  EtcdDirectory(std::shared_ptr<EtcdClient> client, std::string prefix, std::string deployment)
      : client_(std::move(client)),
        prefix_(std::move(prefix)),
        deployment_(std::move(deployment)) {}

  StatusOr<ParallelInfo> GetParallelInfo() override {
    const std::string key_prefix = EtcdDeploymentPrefix(prefix_, deployment_);
    auto range = client_->GetPrefix(key_prefix);
    if (!range.ok()) return Transient(range.status());
    Snapshot snap = BuildSnapshot(prefix_, std::move(range->kvs));
    for (const std::string& why : snap.refused) {
      PDLIB_LOG(kWarning, "etcd discovery: refused under %s: %s", key_prefix, why);
    }
    auto info = snap.table->GetParallelInfo();
    if (!info.ok()) {
      std::string msg =
          absl::StrFormat("no prefill rank of deployment %s is registered in etcd (under %s)",
                          deployment_, key_prefix);
      if (!snap.refused.empty()) {
        msg += absl::StrFormat("; %d entries refused, the first: %s", snap.refused.size(),
                               snap.refused.front());
      }
      return Status::NotFound(msg);
    }
    MutexLock lock(&mu_);
    snapshot_ = std::move(snap);
    return info;
  }

  StatusOr<std::vector<RoomFailure>> GetRoomFailures(const std::vector<uint64_t>& rooms) override {
    if (rooms.size() > kMaxRoomFailuresPerCall) {
      return Status::InvalidArgument(absl::StrFormat("%d rooms in one lookup (at most %d)",
                                                     rooms.size(), kMaxRoomFailuresPerCall));
    }
    const std::string key_prefix = EtcdRoomFailurePrefix(prefix_, deployment_);
    auto range = client_->GetPrefix(key_prefix);
    if (!range.ok()) return Transient(range.status());
    const absl::flat_hash_set<uint64_t> asked(rooms.begin(), rooms.end());
    std::vector<RoomFailure> out;
    for (const auto& kv : range->kvs) {
      uint64_t room = 0;
      // Validated: a key that is not "<prefix>/<deployment>/failed/<room>" is skipped.
      if (!absl::SimpleAtoi(absl::string_view(kv.key).substr(key_prefix.size()), &room) ||
          !asked.contains(room)) {
        continue;
      }
      out.push_back({room, kv.value.substr(0, kMaxRoomFailureReason)});
    }
    return out;
  }

  StatusOr<RankAddress> GetRankAddress(const RankId& id) override {
    {
      MutexLock lock(&mu_);
      if (snapshot_) return AddressLocked(id);
    }
    if (auto info = GetParallelInfo(); !info.ok()) return info.status();
    MutexLock lock(&mu_);
    return AddressLocked(id);
  }

  void Cancel() override {}  // the client is the manager's: DiscoveryBackend::Cancel ends it

 private:
  StatusOr<RankAddress> AddressLocked(const RankId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto address = snapshot_->table->GetRankAddress(id);
    if (!address.ok()) return address.status();
    address->registration_id = static_cast<uint64_t>(snapshot_->mod_revision[id]);
    return address;
  }

  const std::shared_ptr<EtcdClient> client_;
  const std::string prefix_;
  const std::string deployment_;
  Mutex mu_;
  std::optional<Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------------------------

// Holds one rank's key: a lease kept alive every TTL/3 on a thread of its own; the key put back
// (unless a successor took the rank meanwhile) when the lease was lost; revoked when destroyed.
class EtcdPublisher final : public RankPublisher {
 public:
  EtcdPublisher(std::shared_ptr<EtcdClient> client, const KVManagerOptions& o, RankRegistration reg)
      : client_(std::move(client)),
        options_(o),
        registration_(std::move(reg)),
        key_(EtcdRankKey(o.etcd_prefix, JoinHostPort(o.bootstrap_host, o.bootstrap_port),
                         registration_.rank_id())),
        value_(EncodeRegistration(registration_)),
        ttl_seconds_(std::max<int64_t>(1, (o.liveness_timeout.count() + 999) / 1000)) {}

  // Checks the registration against the deployment's, grants the lease and puts the key,
  // retrying what may succeed later until connect_timeout.
  Status Start() {
    const auto deadline = Clock::now() + options_.connect_timeout;
    auto backoff = milliseconds(50);
    Status last;
    while (true) {
      last = TryStart();
      if (last.ok() || !MaySucceedLater(last)) break;
      if (Clock::now() + backoff >= deadline) break;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, milliseconds(1000));
    }
    if (!last.ok()) {
      last = Transient(last);
      return MaySucceedLater(last) ? last.WithPrefix(absl::StrFormat(
                                         "etcd not reachable within connect_timeout %d ms",
                                         options_.connect_timeout.count()))
                                   : last;
    }
    PDLIB_LOG(kInfo, "prefill %s:%d registered in etcd at %s (lease %x, ttl %d s)",
              registration_.host, registration_.port, key_, lease_, ttl_seconds_);
    thread_ = std::thread([this] { KeepAliveLoop(); });
    return Status::OK();
  }

  ~EtcdPublisher() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    cv_.SignalAll();
    if (thread_.joinable()) thread_.join();
    // Withdraw at once: revoking the lease deletes the key (best effort; else it expires).
    int64_t lease = 0;
    {
      MutexLock lock(&mu_);
      lease = lease_;
    }
    if (lease != 0) {
      Status s = client_->RevokeLease(lease, milliseconds(1000));
      if (!s.ok() && s.code() != StatusCode::kNotFound) {
        PDLIB_LOG(kWarning, "prefill %s:%d: withdrawing %s from etcd: %s (it expires in %d s)",
                  registration_.host, registration_.port, key_, s.ToString(), ttl_seconds_);
      }
    }
  }

 private:
  Status TryStart() {
    // The bootstrap server's rules: refuse a layout or fingerprint the deployment disagrees on.
    auto range = client_->GetPrefix(EtcdDeploymentPrefix(
        options_.etcd_prefix, JoinHostPort(options_.bootstrap_host, options_.bootstrap_port)));
    if (!range.ok()) return range.status();
    std::vector<EtcdKeyValue> others;
    for (EtcdKeyValue& kv : range->kvs) {
      if (kv.key != key_) others.push_back(std::move(kv));  // our predecessor is replaced
    }
    Snapshot snap = BuildSnapshot(options_.etcd_prefix, std::move(others));
    if (auto r = snap.table->Register(registration_); !r.ok()) {
      return r.status().WithPrefix("the deployment in etcd refuses this rank");
    }
    auto lease = client_->GrantLease(ttl_seconds_);
    if (!lease.ok()) return lease.status();
    auto put = client_->Put(key_, value_, lease->id);
    if (!put.ok()) {
      client_->RevokeLease(lease->id, milliseconds(500)).IgnoreError();
      return put.status();
    }
    MutexLock lock(&mu_);
    lease_ = lease->id;
    return Status::OK();
  }

  void KeepAliveLoop() {
    const auto period = milliseconds(std::max<int64_t>(300, ttl_seconds_ * 1000 / 3));
    bool warned = false;
    while (true) {
      int64_t lease = 0;
      {
        MutexLock lock(&mu_);
        if (!stopping_) cv_.WaitFor(&mu_, period);
        if (stopping_) return;
        lease = lease_;
      }
      Status s = lease != 0 ? client_->KeepAliveOnce(lease, period).status()
                            : Status::NotFound("no lease");
      if (s.code() == StatusCode::kNotFound) s = Republish();
      if (s.ok()) {
        if (warned)
          PDLIB_LOG(kInfo, "prefill %s:%d: etcd reachable again", registration_.host,
                    registration_.port);
        warned = false;
      } else if (s.code() == StatusCode::kCancelled) {
        return;
      } else if (!warned) {
        PDLIB_LOG(kWarning, "prefill %s:%d: keeping %s alive in etcd: %s (retrying)",
                  registration_.host, registration_.port, key_, s.ToString());
        warned = true;
      }
    }
  }

  // The lease expired (we were cut off from etcd for longer than its TTL): decode has seen
  // the rank disappear. Put it back under a new lease unless another process took the rank.
  Status Republish() {
    auto lease = client_->GrantLease(ttl_seconds_);
    if (!lease.ok()) return lease.status();
    auto put = client_->PutIfAbsent(key_, value_, lease->id);
    if (!put.ok() || !put->succeeded) {
      client_->RevokeLease(lease->id, milliseconds(500)).IgnoreError();
      if (!put.ok()) return put.status();
      MutexLock lock(&mu_);
      lease_ = 0;
      return Status::AlreadyExists(absl::StrFormat(
          "%s is held by another registration now (a successor of this rank): not put back", key_));
    }
    PDLIB_LOG(kWarning, "prefill %s:%d: its etcd lease had expired; registered again at %s",
              registration_.host, registration_.port, key_);
    MutexLock lock(&mu_);
    lease_ = lease->id;
    return Status::OK();
  }

  const std::shared_ptr<EtcdClient> client_;
  const KVManagerOptions options_;
  const RankRegistration registration_;
  const std::string key_;
  const std::string value_;
  const int64_t ttl_seconds_;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;  // 0: none held (taken over by a successor)
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------

class EtcdDiscovery final : public DiscoveryBackend {
 public:
  EtcdDiscovery(const KVManagerOptions& o, std::shared_ptr<EtcdClient> client)
      : options_(o), client_(std::move(client)) {}

  ~EtcdDiscovery() override { Cancel(); }

  std::string Describe() const override {
    return absl::StrFormat("etcd %s (prefix %s)", absl::StrJoin(options_.etcd_endpoints, ","),
                           options_.etcd_prefix);
  }

  StatusOr<std::unique_ptr<RankPublisher>> Publish(const RankRegistration& reg) override {
    auto publisher = std::make_unique<EtcdPublisher>(client_, options_, reg);
    if (Status s = publisher->Start(); !s.ok()) return s;
    return std::unique_ptr<RankPublisher>(std::move(publisher));
  }

  StatusOr<std::unique_ptr<DeploymentDirectory>> Open(std::string_view host,
                                                      uint16_t port) override {
    return std::unique_ptr<DeploymentDirectory>(
        std::make_unique<EtcdDirectory>(client_, options_.etcd_prefix, JoinHostPort(host, port)));
  }

  // One key per room under "<prefix>/<deployment>/failed/", all of one report on one lease of
  // the relay's TTL, so etcd drops them by itself; a room already there keeps its first reason.
  Status ReportRoomFailures(const std::vector<RoomFailure>& failures) override {
    if (failures.empty()) return Status::OK();
    auto lease = client_->GrantLease(kRoomFailureTtlSeconds);
    if (!lease.ok()) return lease.status();
    const std::string key_prefix = EtcdRoomFailurePrefix(
        options_.etcd_prefix, JoinHostPort(options_.bootstrap_host, options_.bootstrap_port));
    for (const RoomFailure& f : failures) {
      auto put = client_->PutIfAbsent(absl::StrCat(key_prefix, f.room),
                                      f.reason.substr(0, kMaxRoomFailureReason), lease->id);
      if (!put.ok()) return put.status();
    }
    return Status::OK();
  }

  Status Watch(std::function<void(const std::string&)> changed) override {
    const std::string prefix = options_.etcd_prefix + "/";
    auto watch = client_->WatchPrefix(
        prefix, EtcdWatchOptions{},
        [prefix = options_.etcd_prefix, changed = std::move(changed)](const EtcdWatchUpdate& u) {
          if (u.resynced) {
            changed("");  // history lost: everything may have changed
            return;
          }
          for (const EtcdWatchEvent& e : u.events) {
            auto parts = ParseEtcdRankKey(prefix, e.kv.key);
            if (parts.ok()) changed(parts->deployment);
          }
        });
    if (!watch.ok()) return watch.status();
    MutexLock lock(&mu_);
    watch_ = std::move(*watch);
    return Status::OK();
  }

  void Cancel() override {
    std::unique_ptr<EtcdWatch> watch;
    {
      MutexLock lock(&mu_);
      watch = std::move(watch_);
    }
    if (watch) watch->Stop();
    client_->Cancel();
  }

 private:
  const KVManagerOptions options_;
  const std::shared_ptr<EtcdClient> client_;
  Mutex mu_;
  std::unique_ptr<EtcdWatch> watch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

StatusOr<std::unique_ptr<DiscoveryBackend>> CreateEtcdDiscovery(const KVManagerOptions& options) {
  auto client = EtcdClient::Create(ClientOptions(options));
  if (!client.ok()) return client.status().WithPrefix("etcd discovery");
  std::shared_ptr<EtcdClient> shared = std::move(*client);
  // Reachable now, or a clear error: the call fails over across every endpoint until
  // connect_timeout.
  const auto deadline = Clock::now() + options.connect_timeout;
  Status probe = Status::DeadlineExceeded("no attempt");
  Status telling;  // the most telling failure: an endpoint's own answer beats a timeout
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left < milliseconds(20)) break;
    probe = shared->Get(options.etcd_prefix, left).status();
    if (probe.ok() || !MaySucceedLater(probe)) break;
    if (telling.ok() || probe.code() != StatusCode::kDeadlineExceeded) telling = probe;
    std::this_thread::sleep_for(std::min<milliseconds>(left, milliseconds(100)));
  }
  if (!probe.ok()) {
    const std::string what = absl::StrFormat(
        "etcd discovery: no endpoint of %s answered within connect_timeout %d ms",
        absl::StrJoin(options.etcd_endpoints, ","), options.connect_timeout.count());
    if (!MaySucceedLater(probe)) return probe.WithPrefix(what);
    return Status::Unavailable(what + ": " +
                               std::string((telling.ok() ? probe : telling).message()));
  }
  return std::unique_ptr<DiscoveryBackend>(
      std::make_unique<EtcdDiscovery>(options, std::move(shared)));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
