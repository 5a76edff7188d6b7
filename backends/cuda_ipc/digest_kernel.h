// DeviceDigester: the KV integrity digest of GPU memory (spi::Transport::DigestRanges) in one
// kernel launch per call: the raw CRC32C of each range, followed by its zeros, computed on the
// device in the decomposition of digest_math.h (a block per 16 KiB tile, a thread per 64-byte
// segment, the tables in shared memory). Built when nvcc is found; the arithmetic is tested
// without a GPU (digest_math_test), the kernel against it on a GPU (digest_kernel_test).
//
// One caller at a time (not thread-safe): the cuda_ipc transport calls it on its progress thread,
// whose current device is the digester's.
//
// No CUDA types here: the stream is a cudaStream_t passed as void*.
#ifndef PDLIB_BACKENDS_CUDA_IPC_DIGEST_KERNEL_H_
#define PDLIB_BACKENDS_CUDA_IPC_DIGEST_KERNEL_H_

#include <cstdint>
#include <memory>
#include <span>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

class DeviceDigester {
 public:
  // kUnavailable with the CUDA runtime's text when there is no usable device.
  static StatusOr<std::unique_ptr<DeviceDigester>> Create(int device);
  ~DeviceDigester();
  DeviceDigester(const DeviceDigester&) = delete;
  DeviceDigester& operator=(const DeviceDigester&) = delete;

  // crcs[i] = the raw CRC32C of ranges[i] (device-accessible addresses) followed by its
  // zeros_after zero bytes. Runs on the digester's own stream after the work already queued on
  // `after` (a cudaStream_t; nullptr: none), and returns once the values are on the host.
  Status Digest(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs,
                void* after = nullptr);

  int device() const { return device_; }
  uint64_t launches() const { return launches_; }

 private:
  DeviceDigester() = default;
  Status Grow(size_t tiles, size_t ranges);

  int device_ = 0;
  void* stream_ = nullptr;      // cudaStream_t
  void* event_ = nullptr;       // cudaEvent_t, for `after`
  void* host_tiles_ = nullptr;  // pinned
  void* dev_tiles_ = nullptr;
  uint32_t* host_crcs_ = nullptr;  // pinned
  uint32_t* dev_crcs_ = nullptr;
  size_t tile_capacity_ = 0;
  size_t crc_capacity_ = 0;
  uint64_t launches_ = 0;
};

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_DIGEST_KERNEL_H_
