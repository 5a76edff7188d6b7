// GPU memory for tests that run a backend over device memory (the conformance suite, the
// planner's end-to-end peers): a cudaMalloc'ed buffer on GPU 0 with copies to and from host
// memory. Builds without CUDA too; then no device is ever usable and WhyNoCudaDevice says so.
#ifndef PDLIB_TEST_SUPPORT_DEVICE_BUFFER_H_
#define PDLIB_TEST_SUPPORT_DEVICE_BUFFER_H_

#include <cstdint>
#include <memory>
#include <string>

namespace pdlib_test {

// Empty when a CUDA device can be used by this process; otherwise why not (the runtime's error,
// or that the build has no CUDA).
std::string WhyNoCudaDevice();

class DeviceBuffer {
 public:
  // A buffer of `bytes` on device 0; empty string on success, else why it failed.
  static std::string Allocate(uint64_t bytes, std::unique_ptr<DeviceBuffer>* out);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  uint64_t size() const { return bytes_; }
  // Whole-buffer copies from and to host memory of size() bytes; empty string or the error.
  std::string Upload(const void* host) const;
  std::string Download(void* host) const;

 private:
  DeviceBuffer() = default;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace pdlib_test

#endif  // PDLIB_TEST_SUPPORT_DEVICE_BUFFER_H_
