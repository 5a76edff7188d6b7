// DiscoveryBackend: where prefill ranks publish their Peer addresses and decode finds them (SPEC
// R6.1), behind one interface with two implementations, chosen by KVManagerOptions::discovery:
//
// - the bootstrap server (BootstrapClient against pdlib-bootstrap or a prefill rank's embedded
//   server; the default);
// - etcd (EtcdClient): registrations under a key prefix per deployment, each held by a lease
//   that the publishing rank keeps alive, so a rank that dies disappears after its TTL without
//   anyone withdrawing it, and a watch that tells decode at once.
//
// A deployment is named by its bootstrap address ("host:port") in both: with etcd nothing runs
// there, the string is only the deployment's key.
//
// Thread-safety: DiscoveryBackend, DeploymentDirectory and RankPublisher may be used from any
// thread, concurrently. Cancel() makes running and later calls return CANCELLED promptly.
#ifndef PDLIB_LIB_CONTROL_DISCOVERY_H_
#define PDLIB_LIB_CONTROL_DISCOVERY_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "lib/control/bootstrap_types.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

// Decode's lookups in one prefill deployment. GetParallelInfo reads the deployment afresh;
// GetRankAddress answers from what the last GetParallelInfo read where the implementation
// reads everything at once (etcd), so a caller resolves with one GetParallelInfo and then the
// ranks it needs.
class DeploymentDirectory {
 public:
  virtual ~DeploymentDirectory() = default;
  // NOT_FOUND while no rank of the deployment is registered.
  virtual StatusOr<ParallelInfo> GetParallelInfo() = 0;
  // INVALID_ARGUMENT out of range of the registered sizes, NOT_FOUND when not registered.
  virtual StatusOr<RankAddress> GetRankAddress(const RankId& id) = 0;
  // The rooms among `rooms` a prefill rank of the deployment failed before any decode rank was
  // bound to them, with the reasons (the room-failure relay): kept by the bootstrap server, or
  // as keys on a lease in etcd.
  virtual StatusOr<std::vector<RoomFailure>> GetRoomFailures(const std::vector<uint64_t>& rooms) {
    (void)rooms;
    return std::vector<RoomFailure>{};
  }
  virtual void Cancel() = 0;
};

// One prefill rank's entry. Destroying it withdraws the entry (best effort, bounded by a
// second or so): a rank that shuts down cleanly is not chosen again.
class RankPublisher {
 public:
  virtual ~RankPublisher() = default;
};

class DiscoveryBackend {
 public:
  // From the manager's options (discovery, bootstrap address, etcd_*, security, timeouts).
  // etcd: fails when no endpoint answers within connect_timeout, naming every endpoint.
  static StatusOr<std::unique_ptr<DiscoveryBackend>> Create(const KVManagerOptions& options);
  virtual ~DiscoveryBackend() = default;

  // "bootstrap server 10.0.0.1:8998" or "etcd 10.0.0.5:2379,10.0.0.6:2379 (prefix /pdlib)"
  virtual std::string Describe() const = 0;

  // Prefill: publishes `registration` in the deployment named by the options' bootstrap
  // address. Bootstrap server: one quick attempt; while the server is unreachable the
  // registration is retried in the background until the publisher is destroyed (prefill may
  // start before its bootstrap server). etcd: retried until connect_timeout, then an error;
  // once published the lease is kept alive in the background and the entry put back if it was
  // lost (lease expired during a partition from etcd).
  // A registration the directory refuses (layout or fingerprint disagrees with the
  // deployment's) is an error at once.
  virtual StatusOr<std::unique_ptr<RankPublisher>> Publish(
      const RankRegistration& registration) = 0;

  // Prefill: tells the deployment's directory of rooms this rank failed before any decode rank
  // was bound to them, so that a decode rank waiting on another rank for one learns it at once.
  // Bootstrap server: one attempt (the caller batches and drops on error); etcd: keys on a
  // lease of the relay's TTL.
  virtual Status ReportRoomFailures(const std::vector<RoomFailure>& failures) {
    (void)failures;
    return Status::OK();
  }
  // Makes running and later ReportRoomFailures calls return CANCELLED (and nothing else).
  virtual void CancelReports() {}

  // Decode: the directory of the deployment at `deployment` ("host:port").
  virtual StatusOr<std::unique_ptr<DeploymentDirectory>> Open(std::string_view host,
                                                              uint16_t port) = 0;

  // Decode: calls `changed(deployment)` (the "host:port" naming it) whenever a rank of a
  // deployment registers, re-registers or disappears, and `changed("")` when any deployment
  // may have changed (etcd compacted the history the watch missed), from a thread of its own;
  // the callback must not block for long. Bootstrap server: never called (decode learns of a
  // dead rank from its stream). Called once at most per DiscoveryBackend.
  virtual Status Watch(std::function<void(const std::string& deployment)> changed) = 0;

  // Ends the watch and makes running and later calls return CANCELLED.
  virtual void Cancel() = 0;
};

// The etcd key layout (pure, for tests and tools).
// "<prefix>/<deployment>/rank/<dp>/<tp>/<pp>"
std::string EtcdRankKey(std::string_view prefix, std::string_view deployment, const RankId& id);
// "<prefix>/<deployment>/rank/"
std::string EtcdDeploymentPrefix(std::string_view prefix, std::string_view deployment);
// "<prefix>/<deployment>/failed/": the room-failure relay's keys, "<that><room>".
std::string EtcdRoomFailurePrefix(std::string_view prefix, std::string_view deployment);
// Splits a key under `prefix` into its deployment and rank; INVALID_ARGUMENT naming what is
// wrong with it otherwise.
struct EtcdRankKeyParts {
  std::string deployment;
  RankId rank;
};
StatusOr<EtcdRankKeyParts> ParseEtcdRankKey(std::string_view prefix, std::string_view key);

// Checks etcd_* options (endpoints "host:port", prefix shape, TLS files with their key).
Status ValidateEtcdOptions(const KVManagerOptions& options);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_DISCOVERY_H_
