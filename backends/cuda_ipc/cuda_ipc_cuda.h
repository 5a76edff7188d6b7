// The CUDA runtime pieces of the cuda_ipc backend: errors as Status, the device probe, RAII for
// streams and events, an allocation's range (the one driver call, fetched through
// cudaGetDriverEntryPointByVersion so that pdlib never links libcuda and loads without a
// driver), and the per-transport cache of opened IPC handles.
//
// Threads: IpcMappings is not thread-safe (the transport's progress thread owns it); the free
// functions may be called from any thread.
#ifndef PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CUDA_H_
#define PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CUDA_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "backends/cuda_ipc/cuda_ipc_wire.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// "cuda_ipc: <call> failed: <cudaGetErrorName>: <cudaGetErrorString> (<context>)". Internal,
// or Unavailable for a lost or absent device.
Status CudaError(const std::string& call, cudaError_t error, const std::string& context = "");

// Devices this process can use; the error says why none (cudaGetDeviceCount's).
struct DeviceProbe {
  int count = 0;
  Status why_none;  // OK when count > 0
};
DeviceProbe ProbeDevices();

// The allocation that holds device address `ptr`: its base and size (cuMemGetAddressRange).
struct AllocationRange {
  uint64_t base = 0;
  uint64_t size = 0;
};
StatusOr<AllocationRange> FindAllocation(uint64_t ptr);

class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  // A non-blocking stream on the current device.
  Status Create();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Opened IPC handles, refcounted by the handle's bytes: CUDA opens one handle once per context
// (a second cudaIpcOpenMemHandle of it fails), while several peers, or several regions of one
// peer, name the same allocation.
class IpcMappings {
 public:
  using Handle = std::array<uint8_t, kIpcHandleBytes>;
  IpcMappings() = default;
  ~IpcMappings();  // closes what is left
  IpcMappings(const IpcMappings&) = delete;
  IpcMappings& operator=(const IpcMappings&) = delete;

  // The allocation's base in this process, opening it on the current device when it is not
  // open yet (cudaIpcMemLazyEnablePeerAccess); every call takes one reference. *size is the
  // mapped allocation's size.
  StatusOr<uint64_t> Open(const Handle& handle, uint64_t* size);
  // Drops one reference; the last one closes the mapping.
  void Release(const Handle& handle);
  size_t open_count() const { return open_.size(); }

 private:
  struct Mapping {
    void* base = nullptr;
    uint64_t size = 0;
    int refs = 0;
  };
  std::map<Handle, Mapping> open_;
};

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_CUDA_H_
