// The in-process KVManager: prefill and decode managers of one process find each other through
// a process-wide hub keyed by the bootstrap address, and exchange the same control messages the
// network control plane carries (Register, TransferInfo, Abort, Status) as direct calls. The
// data plane is the real transport SPI. Used by tests, the fake demo and single-process
// deployments; the gRPC control plane replaces only the hub.
#ifndef PDLIB_LIB_CORE_LOCAL_KV_MANAGER_H_
#define PDLIB_LIB_CORE_LOCAL_KV_MANAGER_H_

#include <memory>

#include "pdlib/kv_manager.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::unique_ptr<KVManager>> CreateLocalKVManager(const KVManagerOptions& options);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_LOCAL_KV_MANAGER_H_
