#include "pdlib/kv_manager.h"

#include "lib/core/grpc_kv_manager.h"
#include "lib/core/local_kv_manager.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::unique_ptr<KVManager>> KVManager::Create(const KVManagerOptions& options) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;
  if (options.control_plane == ControlPlane::kInProcess) return CreateLocalKVManager(options);
  return CreateGrpcKVManager(options);
}

}  // namespace v1
}  // namespace pdlib
