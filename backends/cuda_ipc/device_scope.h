// Makes a CUDA device current for a scope, then puts the caller's device back: for the copy
// engine's kernels (gather_copy.cu, digest_kernel.cu), which may be called from threads whose
// current device is another. CUDA sources only (cuda_runtime.h).
#ifndef PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_
#define PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_

#include <cuda_runtime.h>

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

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_DEVICE_SCOPE_H_
