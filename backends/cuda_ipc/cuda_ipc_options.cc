#include "backends/cuda_ipc/cuda_ipc_options.h"

#include "backends/common/backend_options.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

StatusOr<CudaIpcOptions> ParseCudaIpcOptions(const std::map<std::string, std::string>& options) {
  CudaIpcOptions out;
  toolkit::OptionParser parser("cuda_ipc");
  parser.Choice("cuda_ipc.copy", &out.copy,
                {{"kernel", CopyMode::kKernel}, {"memcpy", CopyMode::kMemcpy}});
  parser.Choice("cuda_ipc.ptracer", &out.ptracer,
                {{"any", Ptracer::kAny}, {"keep", Ptracer::kKeep}});
  parser.Number("cuda_ipc.busy_poll_us", &out.busy_poll_us, 0, 1000000);
  if (Status s = parser.Parse(options); !s.ok()) return s;
  return out;
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
