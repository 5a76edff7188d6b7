// GPU memory for pdlib-transfer-bench --memory cuda: KV pools allocated with cudaMalloc, the
// copies that fill and check them, and the device-to-device copies of the --baseline memcpy
// comparison. Standard C++ only; built over the CUDA runtime when CMake found CUDA
// (PDLIB_HAVE_CUDA), else from cuda_memory_stub.cc, where every call says so.
//
// Errors are messages ("" on success), like the rest of the bench. Each call first makes
// `device` the calling thread's current device, so any thread may call any function.
#ifndef PDLIB_BENCH_TRANSFER_CUDA_MEMORY_H_
#define PDLIB_BENCH_TRANSFER_CUDA_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

namespace pdlib_bench {

// "" when CUDA device `device` can be used; otherwise why not (not built, no driver, no such
// device).
std::string CudaUsable(int device);

// `bytes` of device memory on `device`. Freed by the destructor.
class CudaBuffer {
 public:
  static std::string Allocate(int device, uint64_t bytes, std::unique_ptr<CudaBuffer>* out);
  ~CudaBuffer();
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  CudaBuffer(int device, uint8_t* data, uint64_t size)
      : device_(device), data_(data), size_(size) {}
  int device_;
  uint8_t* data_;
  uint64_t size_;
};

// Synchronous copies between host memory and device memory on `device`, and a fill with zeroes.
std::string CudaCopyToDevice(int device, void* dst, const void* src, uint64_t bytes);
std::string CudaCopyToHost(int device, void* dst, const void* src, uint64_t bytes);
std::string CudaZero(int device, void* dst, uint64_t bytes);

// A stream on `device` for device-to-device copies: Copy enqueues (cudaMemcpyAsync) and returns
// at once, Synchronize waits for every copy enqueued so far.
class CudaCopyStream {
 public:
  static std::string Create(int device, std::unique_ptr<CudaCopyStream>* out);
  ~CudaCopyStream();
  CudaCopyStream(const CudaCopyStream&) = delete;
  CudaCopyStream& operator=(const CudaCopyStream&) = delete;

  std::string Copy(void* dst, const void* src, uint64_t bytes);
  std::string Synchronize();

 private:
  CudaCopyStream(int device, void* stream) : device_(device), stream_(stream) {}
  // Unused in the stub build (cuda_memory_stub.cc), where no stream is ever made.
  [[maybe_unused]] int device_;
  [[maybe_unused]] void* stream_;  // cudaStream_t
};

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_CUDA_MEMORY_H_
