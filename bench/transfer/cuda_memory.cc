// cuda_memory.h over the CUDA runtime (built when PDLIB_HAVE_CUDA).
#include "bench/transfer/cuda_memory.h"

#include <cuda_runtime.h>

namespace pdlib_bench {
namespace {

std::string Error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

std::string SetDevice(int device) {
  const cudaError_t e = cudaSetDevice(device);
  return e == cudaSuccess ? ""
                          : Error(("cudaSetDevice(" + std::to_string(device) + ")").c_str(), e);
}

}  // namespace

std::string CudaUsable(int device) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return Error("cudaGetDeviceCount", e);
  }
  if (device < 0 || device >= count) {
    return "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
           " device(s))";
  }
  return SetDevice(device);
}

std::string CudaBuffer::Allocate(int device, uint64_t bytes, std::unique_ptr<CudaBuffer>* out) {
  if (std::string e = SetDevice(device); !e.empty()) return e;
  void* p = nullptr;
  if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    return Error(("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str(), e);
  }
  out->reset(new CudaBuffer(device, static_cast<uint8_t*>(p), bytes));
  return "";
}

CudaBuffer::~CudaBuffer() {
  if (SetDevice(device_).empty()) cudaFree(data_);
}

std::string CudaCopyToDevice(int device, void* dst, const void* src, uint64_t bytes) {
  if (std::string e = SetDevice(device); !e.empty()) return e;
  // Synchronised: the transports copy on non-blocking streams, which do not wait for this one.
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return e == cudaSuccess ? "" : Error("cudaMemcpy host to device", e);
}

std::string CudaCopyToHost(int device, void* dst, const void* src, uint64_t bytes) {
  if (std::string e = SetDevice(device); !e.empty()) return e;
  const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? "" : Error("cudaMemcpy device to host", e);
}

std::string CudaZero(int device, void* dst, uint64_t bytes) {
  if (std::string e = SetDevice(device); !e.empty()) return e;
  cudaError_t e = cudaMemset(dst, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return e == cudaSuccess ? "" : Error("cudaMemset", e);
}

std::string CudaCopyStream::Create(int device, std::unique_ptr<CudaCopyStream>* out) {
  if (std::string e = SetDevice(device); !e.empty()) return e;
  cudaStream_t stream = nullptr;
  if (const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return Error("cudaStreamCreate", e);
  }
  out->reset(new CudaCopyStream(device, stream));
  return "";
}

CudaCopyStream::~CudaCopyStream() {
  if (SetDevice(device_).empty()) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

std::string CudaCopyStream::Copy(void* dst, const void* src, uint64_t bytes) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                        static_cast<cudaStream_t>(stream_));
  return e == cudaSuccess ? "" : Error("cudaMemcpyAsync device to device", e);
}

std::string CudaCopyStream::Synchronize() {
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  return e == cudaSuccess ? "" : Error("cudaStreamSynchronize", e);
}

}  // namespace pdlib_bench
