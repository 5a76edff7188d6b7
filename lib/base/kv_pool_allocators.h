// Backends that allocate KV pools themselves (pdlib/kv_pool.h) register an allocator here, from
// their RegisterXxxBackend() call. Lives in pdlib_base, which every backend links, so that a
// backend can register whether or not the engine ever calls AllocateKVPool.
#ifndef PDLIB_LIB_BASE_KV_POOL_ALLOCATORS_H_
#define PDLIB_LIB_BASE_KV_POOL_ALLOCATORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "pdlib/kv_pool.h"

namespace pdlib {
inline namespace v1 {
namespace internal {

// `mode`: the side whose manager will register the pool (backends may configure themselves per
// side, spi::TransportOptions::mode).
using KVPoolAllocator = std::function<StatusOr<std::unique_ptr<KVPool>>(
    uint64_t bytes, MemoryKind kind, const std::map<std::string, std::string>& backend_options,
    Mode mode)>;

// Registers `backend`'s allocator (a second registration under the same name is ignored).
// Thread-safe.
void RegisterKVPoolAllocator(std::string_view backend, KVPoolAllocator allocator);

// The allocator registered for `backend`, or an empty function.
KVPoolAllocator FindKVPoolAllocator(std::string_view backend);

}  // namespace internal
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_BASE_KV_POOL_ALLOCATORS_H_
