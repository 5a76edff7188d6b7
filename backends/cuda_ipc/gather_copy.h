// GatherCopier: performs a batch of CopyDescs (copy_plan.h) on a GPU with one kernel launch, so
// that an M:N tensor-parallel re-layout (a head range of every page, HND or NHD) moves in one
// pass instead of one small copy per head and page. Pointers are device-accessible addresses:
// local device memory or peer memory mapped with cudaIpcOpenMemHandle.
//
// One caller at a time (not thread-safe). Owned by its creator; destroy it only after the
// kernels it enqueued are done or their streams are no longer used (the destructor waits for
// the copier's own descriptor buffers to be released, not for the caller's streams).
//
// No CUDA types here: the stream is a cudaStream_t passed as void*.
#ifndef PDLIB_BACKENDS_CUDA_IPC_GATHER_COPY_H_
#define PDLIB_BACKENDS_CUDA_IPC_GATHER_COPY_H_

#include <cstdint>
#include <memory>
#include <span>

#include "backends/cuda_ipc/copy_plan.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

class GatherCopier {
 public:
  // The tile the kernel's blocks take: 256 threads x 4 vectors (16 KiB of 16-byte vectors).
  static constexpr uint32_t kThreads = 256;
  static constexpr uint32_t kUnroll = 4;
  static constexpr uint32_t kTileUnits = kThreads * kUnroll;
  // Descriptor slots in flight: the fifth Enqueue waits until the first one's kernel is done.
  static constexpr int kRingSlots = 4;

  // kUnavailable with cudaGetErrorString's text when there is no usable device; kInvalidArgument
  // when `device` is out of range.
  static StatusOr<std::unique_ptr<GatherCopier>> Create(int device);
  ~GatherCopier();
  GatherCopier(const GatherCopier&) = delete;
  GatherCopier& operator=(const GatherCopier&) = delete;

  // Enqueues ONE kernel on `stream` (a cudaStream_t; nullptr: the legacy default stream) that
  // performs every desc. The descriptors are tiled (PlanTiles), staged in one of the copier's
  // pinned host slots and copied to that slot's device buffer on `stream` (both grown as
  // needed), so `descs` may be reused on return. A slot is reused only after an event recorded
  // behind its kernel has completed, so batches on different streams never share descriptor
  // memory while a kernel may still read it. An empty span enqueues nothing. Invalid
  // descriptors (ValidateDescs) are refused with kInvalidArgument before anything is enqueued.
  Status Enqueue(std::span<const CopyDesc> descs, void* stream);

  int device() const { return device_; }

 private:
  struct Rep;
  GatherCopier(int device, std::unique_ptr<Rep> rep);

  int device_;
  std::unique_ptr<Rep> rep_;
};

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_GATHER_COPY_H_
