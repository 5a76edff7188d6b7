// Discovery through etcd (discovery.h): the implementation behind DiscoveryBackend::Create for
// KVManagerOptions::discovery == kEtcd.
#ifndef PDLIB_LIB_CONTROL_DISCOVERY_ETCD_H_
#define PDLIB_LIB_CONTROL_DISCOVERY_ETCD_H_

#include <memory>

#include "lib/control/discovery.h"

namespace pdlib {
inline namespace v1 {
namespace control {

// Options are validated (ValidateEtcdOptions). Fails when no endpoint answers within
// connect_timeout.
StatusOr<std::unique_ptr<DiscoveryBackend>> CreateEtcdDiscovery(const KVManagerOptions& options);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_DISCOVERY_ETCD_H_
