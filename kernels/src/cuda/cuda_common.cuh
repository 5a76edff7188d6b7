// Shared helpers of the CUDA sources: cudaError_t -> Status, an owning device buffer, and the
// scalar helpers every kernel uses. Included only by .cu files.
#ifndef PDLIB_KERNELS_SRC_CUDA_CUDA_COMMON_CUH_
#define PDLIB_KERNELS_SRC_CUDA_CUDA_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "pdlib/status.h"

namespace pdlib::kernels::internal {

inline Status CudaStatus(cudaError_t err, const char* what, const char* file, int line) {
  return Status::Internal(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ") in " + what + " at " + file + ":" +
                          std::to_string(line));
}

#define PDLIB_CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                           \
    cudaError_t pdlib_cuda_err_ = (expr);                                                        \
    if (pdlib_cuda_err_ != cudaSuccess) {                                                        \
      return ::pdlib::kernels::internal::CudaStatus(pdlib_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                            \
  } while (0)

// Owns one cudaMalloc allocation from creation to destruction. Grow() never shrinks and does
// not keep contents.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  Status Grow(size_t bytes) {
    if (bytes <= bytes_ && ptr_ != nullptr) return Status::OK();
    Release();
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
    if (err != cudaSuccess) {
      return Status::ResourceExhausted("cudaMalloc of " + std::to_string(bytes) +
                                       " bytes failed: " + cudaGetErrorString(err));
    }
    ptr_ = p;
    bytes_ = bytes;
    return Status::OK();
  }

  // Grows to `bytes` and copies `src` in on `stream` (pageable host memory: the call returns
  // once `src` may be reused).
  Status Upload(const void* src, size_t bytes, cudaStream_t stream) {
    Status s = Grow(bytes);
    if (!s.ok()) return s;
    if (bytes > 0) {
      PDLIB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ptr_, src, bytes, cudaMemcpyHostToDevice, stream));
    }
    return Status::OK();
  }

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Owns a cudaStream_t. The stream is a blocking one: it orders after the legacy default stream,
// so plain cudaMemcpy calls (KVCache::WritePage) finish before later kernels read their bytes.
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  Status Create() {
    PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&stream_));
    return Status::OK();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CUDA_CUDA_COMMON_CUH_
