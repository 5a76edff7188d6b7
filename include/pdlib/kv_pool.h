// KVPool: memory for an engine's KV pools, allocated the way a backend moves it fastest.
//
// Any memory may go into KVArgs. Some backends write faster into memory they allocated
// themselves: with UCX (1.13) over shared memory, a put into memory UCX allocated is one direct
// copy by the writer, while a put into other memory is emulated with active messages (copied
// through a FIFO, then into place by the target's CPU). AllocateKVPool asks the backend for such
// memory before the KVManager exists: carve the KV buffers out of the pool and put their
// addresses in KVArgs as usual. A KVManager created with the same backend and backend_options
// recognises ranges inside a live pool and reuses the backend's mapping.
//
//   auto pool = pdlib::AllocateKVPool("ucx", bytes, pdlib::MemoryKind::kHost, o.backend_options);
//   o.args.kv.ptrs = {base((*pool)->data()), base((*pool)->data()) + layer_bytes, ...};
//   auto manager = pdlib::KVManager::Create(o);
//
// Backends without an allocator of their own ("fake", out-of-tree ones) get plain host memory:
// page-aligned, zero-filled, backed by the kernel as it is first touched.
//
// Ownership: the caller owns the pool. Either the pool or a manager that registered ranges of it
// may be destroyed first, but no transfer may be in flight into or out of a pool when it goes.
// The memory must not be used after the pool is destroyed.
// Threads: AllocateKVPool may be called from any thread; a KVPool's accessors are const and
// thread-safe.
#ifndef PDLIB_KV_POOL_H_
#define PDLIB_KV_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "pdlib/export.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

class PDLIB_EXPORT KVPool {
 public:
  virtual ~KVPool() = default;

  virtual void* data() const = 0;
  // At least the bytes asked for (a backend may round up to its allocation unit).
  virtual uint64_t size() const = 0;
  virtual MemoryKind kind() const = 0;
  // Who allocated it: a backend's name (e.g. "ucx"), or "host" for plain host memory.
  virtual std::string_view allocator() const = 0;
};

// Allocates `bytes` of `kind` memory for the backend named `backend`, configured by
// `backend_options` (pass KVManagerOptions::backend_options: the UCX backend shares its mapping
// only with managers whose UCX configuration is the same, which includes ucx.net_devices; set it
// explicitly rather than through KVArgs::nic_names when using a pool). Errors: kNotFound for an
// unknown backend (listing the known ones), kInvalidArgument for 0 bytes or bad options,
// kUnimplemented for CUDA memory from a backend without its own allocator (allocate it yourself
// and register it through KVArgs), kResourceExhausted when the memory cannot be had.
// UCX allocates CUDA memory on the calling thread's current device, and only when it was built
// with CUDA support.
PDLIB_EXPORT StatusOr<std::unique_ptr<KVPool>> AllocateKVPool(
    std::string_view backend, uint64_t bytes, MemoryKind kind = MemoryKind::kHost,
    const std::map<std::string, std::string>& backend_options = {});

// The same, for a pool that a manager of `mode` (KVManagerOptions::mode) will register. A backend
// that configures itself per side allocates where that side's manager will look (ucx: decode's
// UCX context runs without UCX keepalive, so a decode pool allocated without its mode is foreign
// to the decode manager, which then cannot write into it directly). The overload without a mode
// allocates for prefill.
PDLIB_EXPORT StatusOr<std::unique_ptr<KVPool>> AllocateKVPool(
    std::string_view backend, uint64_t bytes, MemoryKind kind,
    const std::map<std::string, std::string>& backend_options, Mode mode);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_KV_POOL_H_
