#include "backends/cuda_ipc/cuda_ipc_cuda.h"

#include <cuda.h>  // types of the driver entry point only; libcuda is never linked

#include <cstring>
#include <mutex>

#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

using GetAddressRangeFn = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

// cuMemGetAddressRange from the driver the runtime loaded (ABI of CUDA 12.0, which every driver
// that runs this CUDA 13 runtime provides), or why it is not there.
StatusOr<GetAddressRangeFn> AddressRangeFn() {
  static std::once_flag once;
  static GetAddressRangeFn fn = nullptr;
  static cudaError_t error = cudaSuccess;
  static cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSuccess;
  std::call_once(once, [] {
    void* p = nullptr;
    error = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                             &query);
    if (error == cudaSuccess && query == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<GetAddressRangeFn>(p);
    }
  });
  if (fn != nullptr) return fn;
  if (error != cudaSuccess) return CudaError("cudaGetDriverEntryPointByVersion", error);
  return Status::Internal("cuda_ipc: the driver has no cuMemGetAddressRange (query result " +
                          std::to_string(static_cast<int>(query)) + ")");
}

}  // namespace

Status CudaError(const std::string& call, cudaError_t error, const std::string& context) {
  std::string text = "cuda_ipc: " + call + " failed: " + cudaGetErrorName(error) + ": " +
                     cudaGetErrorString(error);
  if (!context.empty()) text += " (" + context + ")";
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalAddress: return Status::Unavailable(text);
    default: return Status::Internal(text);
  }
}

DeviceProbe ProbeDevices() {
  DeviceProbe probe;
  const cudaError_t error = cudaGetDeviceCount(&probe.count);
  if (error != cudaSuccess) {
    probe.count = 0;
    probe.why_none = CudaError("cudaGetDeviceCount", error);
    cudaGetLastError();  // not sticky, but leave no error behind for the host's own CUDA code
  } else if (probe.count == 0) {
    probe.why_none = Status::Unavailable("cuda_ipc: cudaGetDeviceCount reports 0 devices");
  }
  return probe;
}

StatusOr<AllocationRange> FindAllocation(uint64_t ptr) {
  auto fn = AddressRangeFn();
  if (!fn.ok()) return fn.status();
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult result = (*fn)(&base, &size, static_cast<CUdeviceptr>(ptr));
  if (result != CUDA_SUCCESS) {
    return Status::InvalidArgument("cuda_ipc: cuMemGetAddressRange of " + std::to_string(ptr) +
                                   " failed with CUresult " + std::to_string(result) +
                                   " (not device memory of a CUDA allocation?)");
  }
  return AllocationRange{static_cast<uint64_t>(base), static_cast<uint64_t>(size)};
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status CudaStream::Create() {
  const cudaError_t error = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (error != cudaSuccess) return CudaError("cudaStreamCreateWithFlags", error);
  return Status::OK();
}

IpcMappings::~IpcMappings() {
  for (auto& [handle, mapping] : open_) {
    if (mapping.refs > 0) {
      PDLIB_LOG(kWarning, "cuda_ipc: closing an IPC mapping still referenced %d times",
                mapping.refs);
    }
    cudaIpcCloseMemHandle(mapping.base);
  }
}

StatusOr<uint64_t> IpcMappings::Open(const Handle& handle, uint64_t* size) {
  auto it = open_.find(handle);
  if (it == open_.end()) {
    cudaIpcMemHandle_t raw;
    static_assert(sizeof(raw) == kIpcHandleBytes);
    std::memcpy(&raw, handle.data(), sizeof(raw));
    void* base = nullptr;
    const cudaError_t error = cudaIpcOpenMemHandle(&base, raw, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      cudaGetLastError();
      return CudaError("cudaIpcOpenMemHandle", error,
                       "the peer's allocation; is it on this node and still allocated?");
    }
    uint64_t mapped = 0;
    auto range = FindAllocation(reinterpret_cast<uint64_t>(base));
    if (!range.ok()) {
      cudaIpcCloseMemHandle(base);
      return range.status();
    }
    mapped = range->size;
    it = open_.emplace(handle, Mapping{base, mapped, 0}).first;
  }
  ++it->second.refs;
  *size = it->second.size;
  return reinterpret_cast<uint64_t>(it->second.base);
}

void IpcMappings::Release(const Handle& handle) {
  auto it = open_.find(handle);
  if (it == open_.end() || --it->second.refs > 0) return;
  const cudaError_t error = cudaIpcCloseMemHandle(it->second.base);
  if (error != cudaSuccess) {
    PDLIB_LOG(kWarning, "%s", CudaError("cudaIpcCloseMemHandle", error).ToString().c_str());
  }
  open_.erase(it);
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
