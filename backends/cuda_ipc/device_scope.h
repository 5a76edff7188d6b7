// Makes a CUDA device current for a scope, then puts the caller's device back: for the copy
// engine's kernels (gather_copy.cu, digest_kernel.cu), which may be called from threads whose
// current device is another. CUDA sources only (cuda_runtime.h).
#ifndef PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_
#define PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_

#include <cuda_runtime.h>

#include <string>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = status_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

// Whether `device` can be used by the copy engine's kernels: kUnavailable with the runtime's
// text when there is no usable device, kInvalidArgument when `device` is out of range.
inline Status CheckCudaDevice(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return Status::Unavailable(std::string("no CUDA device: ") + cudaGetErrorString(e));
  }
  if (count == 0) return Status::Unavailable("no CUDA device: cudaGetDeviceCount found none");
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " out of range [0, " +
                                   std::to_string(count) + ")");
  }
  return Status::OK();
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_
