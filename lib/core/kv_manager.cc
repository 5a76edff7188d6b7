#include "pdlib/kv_manager.h"

#include "lib/core/grpc_kv_manager.h"
#include "lib/core/local_kv_manager.h"
#include "lib/core/manager_common.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::unique_ptr<KVManager>> KVManager::Create(const KVManagerOptions& options) {
  if (Status s = ValidateOptions(options); !s.ok()) return s;
  // The wire version is this library's, not the engine's (in-process peers compare it too).
  KVManagerOptions o = options;
  o.args.fingerprint.wire_version = PDLIB_WIRE_VERSION;
  o.args.fingerprint.checksum = ChecksumSetting(o);
  if (o.control_plane == ControlPlane::kInProcess) return CreateLocalKVManager(o);
  return CreateGrpcKVManager(o);
}

}  // namespace v1
}  // namespace pdlib
