// Writing (process_vm_writev) or reading (process_vm_readv, pull) another process's host memory
// on this node with Linux cross-memory attach: the cuda_ipc backend's path for host regions (the
// aux and metadata buffers).
// The kernel checks ptrace access: same user, and under Yama ptrace_scope 1 the target must
// have allowed it (PR_SET_PTRACER; the target side of cuda_ipc does unless cuda_ipc.ptracer=keep).
#ifndef PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CMA_H_
#define PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CMA_H_

#include <cstdint>
#include <span>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// One piece: `bytes` from our `src` to `dst` in the target process.
struct CmaWrite {
  const void* src = nullptr;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

// One piece read: `bytes` from `src` in the target process to our `dst`.
struct CmaRead {
  uint64_t src = 0;
  void* dst = nullptr;
  uint64_t bytes = 0;
};

// Writes every piece into process `pid`, IOV_MAX pieces per system call, resuming after partial
// writes. Errors name the pid and strerror: Unavailable when the process is gone (ESRCH) or an
// address is not mapped there (EFAULT), PermissionDenied with the ptrace hint (EPERM).
Status WriteProcessMemory(int32_t pid, std::span<const CmaWrite> writes);

// Reads every piece from process `pid` with process_vm_readv, the same way (and the same errors,
// "a source is not mapped" for EFAULT).
Status ReadProcessMemory(int32_t pid, std::span<const CmaRead> reads);

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CMA_H_
