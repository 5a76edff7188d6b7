// The cuda_ipc backend's options (TransportOptions::options, keys "cuda_ipc.*"); each key is
// documented in README.md. Pure: parsed with the toolkit's OptionParser, unit-tested directly.
#ifndef PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_OPTIONS_H_
#define PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_OPTIONS_H_

#include <cstdint>
#include <map>
#include <string>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// How a batch's GPU-to-GPU writes are issued.
enum class CopyMode {
  kKernel,  // one gather kernel per batch over its coalesced descriptors
  kMemcpy,  // one cudaMemcpyAsync per coalesced descriptor (comparison path, no peer access)
};

// Whether a target lets any process of its user write its host regions (process_vm_writev).
enum class Ptracer {
  kAny,   // prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) when the first endpoint is created
  kKeep,  // leave the process's ptrace policy alone (Yama ptrace_scope 1 then refuses CMA)
};

struct CudaIpcOptions {
  CopyMode copy = CopyMode::kKernel;
  Ptracer ptracer = Ptracer::kAny;
  uint64_t busy_poll_us = 50;  // progress thread: polling after the last work before sleeping
};

StatusOr<CudaIpcOptions> ParseCudaIpcOptions(const std::map<std::string, std::string>& options);

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_OPTIONS_H_
