// The KVManager over the gRPC control plane: prefill serves the Peer service and registers with
// the bootstrap server (optionally hosting it); decode resolves prefill ranks through the
// bootstrap server, in the background, and keeps one stream per prefill rank.
#ifndef PDLIB_LIB_CORE_GRPC_KV_MANAGER_H_
#define PDLIB_LIB_CORE_GRPC_KV_MANAGER_H_

#include <memory>

#include "pdlib/kv_manager.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::unique_ptr<KVManager>> CreateGrpcKVManager(const KVManagerOptions& options);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_GRPC_KV_MANAGER_H_
