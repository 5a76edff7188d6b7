#include "lib/base/kv_pool_allocators.h"

#include "lib/base/mutex.h"

namespace pdlib {
inline namespace v1 {
namespace internal {
namespace {

struct Allocators {
  Mutex mu;
  std::map<std::string, KVPoolAllocator, std::less<>> by_backend ABSL_GUARDED_BY(mu);
};

Allocators& GetAllocators() {
  static Allocators* allocators = new Allocators();  // never destroyed: used until exit
  return *allocators;
}

}  // namespace

void RegisterKVPoolAllocator(std::string_view backend, KVPoolAllocator allocator) {
  Allocators& a = GetAllocators();
  MutexLock lock(&a.mu);
  a.by_backend.try_emplace(std::string(backend), std::move(allocator));
}

KVPoolAllocator FindKVPoolAllocator(std::string_view backend) {
  Allocators& a = GetAllocators();
  MutexLock lock(&a.mu);
  auto it = a.by_backend.find(backend);
  return it == a.by_backend.end() ? KVPoolAllocator() : it->second;
}

}  // namespace internal
}  // namespace v1
}  // namespace pdlib
