// Memory for KV pools that UCX allocates itself (ucp_mem_map with UCP_MEM_MAP_ALLOCATE), for
// engines that want the fastest path; an engine may always register its own memory instead.
//
// Why it matters with UCX 1.13: UCX writes straight into a peer's memory over shared memory
// (posix/sysv) only when that memory was allocated by those transports. For memory the engine
// allocated, puts are emulated with active messages: copied into a FIFO by the initiator, then
// out of it by the target's progress thread, which costs target CPU and a second copy (and the
// target writes wherever the initiator's message says). Register a range inside a UcxMemory with
// the same transport (RegisterMemory) and the transport reuses UCX's mapping, so the key blob it
// returns carries the shared-memory key and the initiator copies once, directly.
//
// Internal to the backend: public headers do not depend on UCX. An engine reaches this through
// whatever public surface the core offers (e.g. a KVManager method that allocates through its
// transport), not by including this file.
//
// Thread-safety: AllocateWithUcx may be called from any thread; a UcxMemory may be destroyed on
// any thread, also after its transport (the UCP context lives until its last allocation does).
#ifndef PDLIB_BACKENDS_UCX_UCX_ALLOCATOR_H_
#define PDLIB_BACKENDS_UCX_UCX_ALLOCATOR_H_

#include <cstdint>
#include <memory>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

struct UcxContext;

// Owns memory allocated by UCX; frees it (ucp_mem_unmap) when destroyed and no longer
// registered. Registrations made from it must be deregistered before the memory is reused.
class UcxMemory {
 public:
  ~UcxMemory();
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }

 private:
  friend StatusOr<std::unique_ptr<UcxMemory>> AllocateWithUcx(spi::Transport& transport,
                                                              uint64_t bytes, MemoryKind kind);
  UcxMemory(std::shared_ptr<UcxContext> context, void* data, uint64_t size, MemoryKind kind)
      : context_(std::move(context)), data_(data), size_(size), kind_(kind) {}

  std::shared_ptr<UcxContext> context_;
  void* data_;
  uint64_t size_;
  MemoryKind kind_;
};

// Allocates at least `bytes` (rounded up by UCX to its allocation unit) in the UCP context of
// `transport`, which must be a "ucx" transport (kInvalidArgument otherwise). kCuda needs a
// CUDA-enabled UCX (kFailedPrecondition otherwise).
StatusOr<std::unique_ptr<UcxMemory>> AllocateWithUcx(spi::Transport& transport, uint64_t bytes,
                                                     MemoryKind kind = MemoryKind::kHost);

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_ALLOCATOR_H_
