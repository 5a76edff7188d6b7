#include "test/support/device_buffer.h"

#if defined(PDLIB_TEST_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pdlib_test {

#if defined(PDLIB_TEST_HAVE_CUDA)
namespace {

std::string Error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

}  // namespace

std::string WhyNoCudaDevice() {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return Error("cudaGetDeviceCount", e);
  }
  return count > 0 ? "" : "cudaGetDeviceCount found no device";
}

std::string DeviceBuffer::Allocate(uint64_t bytes, std::unique_ptr<DeviceBuffer>* out) {
  std::unique_ptr<DeviceBuffer> buffer(new DeviceBuffer());
  if (cudaError_t e = cudaSetDevice(0); e != cudaSuccess) return Error("cudaSetDevice(0)", e);
  if (cudaError_t e = cudaMalloc(&buffer->ptr_, bytes); e != cudaSuccess) {
    return Error("cudaMalloc", e);
  }
  buffer->bytes_ = bytes;
  *out = std::move(buffer);
  return "";
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

std::string DeviceBuffer::Upload(const void* host) const {
  cudaError_t e = cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice);
  return e == cudaSuccess ? "" : Error("cudaMemcpy to the device", e);
}

std::string DeviceBuffer::Download(void* host) const {
  cudaError_t e = cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? "" : Error("cudaMemcpy from the device", e);
}

#else  // no CUDA in this build

namespace {
constexpr const char* kNoCuda = "this build has no CUDA (PDLIB_WITH_CUDA=OFF or nvcc not found)";
}

std::string WhyNoCudaDevice() { return kNoCuda; }
std::string DeviceBuffer::Allocate(uint64_t, std::unique_ptr<DeviceBuffer>*) { return kNoCuda; }
DeviceBuffer::~DeviceBuffer() = default;
std::string DeviceBuffer::Upload(const void*) const { return kNoCuda; }
std::string DeviceBuffer::Download(void*) const { return kNoCuda; }

#endif

}  // namespace pdlib_test
