// AllocateKVPool: the backend's own allocator when it registered one
// (lib/base/kv_pool_allocators.h), plain host memory otherwise.
#include "pdlib/kv_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "lib/base/kv_pool_allocators.h"
#include "pdlib/backends.h"

namespace pdlib {
inline namespace v1 {
namespace {

// An anonymous private mapping: page-aligned, zero-filled, backed as it is touched.
class HostKVPool final : public KVPool {
 public:
  HostKVPool(void* data, uint64_t size) : data_(data), size_(size) {}
  ~HostKVPool() override { ::munmap(data_, size_); }
  HostKVPool(const HostKVPool&) = delete;
  HostKVPool& operator=(const HostKVPool&) = delete;

  void* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  MemoryKind kind() const override { return MemoryKind::kHost; }
  std::string_view allocator() const override { return "host"; }

 private:
  void* data_;
  uint64_t size_;
};

}  // namespace

StatusOr<std::unique_ptr<KVPool>> AllocateKVPool(
    std::string_view backend, uint64_t bytes, MemoryKind kind,
    const std::map<std::string, std::string>& backend_options) {
  return AllocateKVPool(backend, bytes, kind, backend_options, Mode::kPrefill);
}

StatusOr<std::unique_ptr<KVPool>> AllocateKVPool(
    std::string_view backend, uint64_t bytes, MemoryKind kind,
    const std::map<std::string, std::string>& backend_options, Mode mode) {
  // ListBackends() also registers the built-in backends, and with them their allocators.
  const std::vector<std::string> known = ListBackends();
  if (std::find(known.begin(), known.end(), backend) == known.end()) {
    std::string names;
    for (const std::string& name : known) names += (names.empty() ? "" : ", ") + name;
    return Status::NotFound("AllocateKVPool: unknown backend '" + std::string(backend) +
                            "'; known backends: " + names);
  }
  if (bytes == 0) return Status::InvalidArgument("AllocateKVPool: cannot allocate 0 bytes");
  if (internal::KVPoolAllocator allocator = internal::FindKVPoolAllocator(backend)) {
    return allocator(bytes, kind, backend_options, mode);
  }
  if (kind != MemoryKind::kHost) {
    return Status::Unimplemented("AllocateKVPool: backend '" + std::string(backend) +
                                 "' has no allocator of its own, and pdlib allocates only host "
                                 "memory; allocate " +
                                 std::string(MemoryKindName(kind)) +
                                 " memory yourself and put it in KVArgs");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted("AllocateKVPool: mmap of " + std::to_string(bytes) +
                                     " bytes failed: " + std::strerror(errno));
  }
  return std::unique_ptr<KVPool>(new HostKVPool(p, bytes));
}

}  // namespace v1
}  // namespace pdlib
