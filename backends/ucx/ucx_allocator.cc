#include "backends/ucx/ucx_allocator.h"

#include <algorithm>

#include "backends/ucx/ucx_transport.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

StatusOr<std::unique_ptr<UcxMemory>> AllocateWithUcx(spi::Transport& transport, uint64_t bytes,
                                                     MemoryKind kind) {
  auto* ucx = dynamic_cast<UcxTransport*>(&transport);
  if (ucx == nullptr) {
    return Status::InvalidArgument("ucx: AllocateWithUcx needs a ucx transport, not '" +
                                   std::string(transport.name()) + "'");
  }
  if (bytes == 0) return Status::InvalidArgument("ucx: cannot allocate 0 bytes");
  std::shared_ptr<UcxContext> context = ucx->context();
  if (kind == MemoryKind::kCuda && !context->cuda_supported) {
    return Status::FailedPrecondition(
        "ucx: cannot allocate CUDA memory: this UCX reports no CUDA "
        "support");
  }
  // A context-level call: the context is created with mt_workers_shared, so UCX serialises it
  // against the progress thread's own context-level calls.
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  params.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h raw = nullptr;
  ucs_status_t st = ucp_mem_map(context->handle.get(), &params, &raw);
  if (st != UCS_OK) {
    return Status::ResourceExhausted("ucx: ucp_mem_map could not allocate " +
                                     std::to_string(bytes) + " bytes: " + UcsStatusName(st));
  }
  auto memh = std::make_shared<UcpMemh>(context->handle.get(), raw);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(raw, &attr);
  if (st != UCS_OK) return Status::Internal("ucx: ucp_mem_query failed: " + UcsStatusName(st));
  {
    MutexLock lock(&context->mu);
    context->allocations.push_back(
        UcxAllocationRecord{reinterpret_cast<uintptr_t>(attr.address), attr.length, kind, memh});
  }
  return std::unique_ptr<UcxMemory>(
      new UcxMemory(std::move(context), attr.address, attr.length, kind));
}

UcxMemory::~UcxMemory() {
  std::shared_ptr<UcpMemh> memh;  // unmapped after the lock, unless a registration still uses it
  MutexLock lock(&context_->mu);
  auto& all = context_->allocations;
  auto it = std::find_if(all.begin(), all.end(), [this](const UcxAllocationRecord& a) {
    return a.addr == reinterpret_cast<uintptr_t>(data_);
  });
  if (it != all.end()) {
    memh = std::move(it->memh);
    all.erase(it);
  }
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
