// The UCP contexts of a process: one per UCX configuration, shared by every UCX transport and
// every KV pool (pdlib/kv_pool.h) configured alike, so that a transport recognises memory that
// UCX allocated for a pool before the transport existed and reuses UCX's own mapping of it.
//
// Why the mapping matters with UCX 1.13: UCX writes straight into a peer's memory over shared
// memory (posix/sysv) only when that memory was allocated by those transports (the packed rkey
// then names the shared segment and the writer copies once, directly). For memory the engine
// allocated, puts are emulated with active messages: copied into a FIFO by the initiator, then
// out of it by the target's progress thread, which costs target CPU and a second copy.
//
// Threads: AcquireUcxContext and the pool functions may be called from any thread. A context is
// created with mt_workers_shared, which makes UCX lock its context-level calls (ucp_mem_map/unmap,
// ucp_rkey_pack), so pools may come and go on engine threads while progress threads work. A
// context lives until its last transport and its last pool are gone.
#ifndef PDLIB_BACKENDS_UCX_UCX_CONTEXT_H_
#define PDLIB_BACKENDS_UCX_UCX_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backends/ucx/ucx_handles.h"
#include "backends/ucx/ucx_options.h"
#include "lib/base/mutex.h"
#include "pdlib/kv_pool.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

// Memory that UCX allocated (ucp_mem_map with UCP_MEM_MAP_ALLOCATE) for a live KV pool.
struct UcxAllocationRecord {
  uintptr_t addr = 0;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  std::shared_ptr<UcpMemh> memh;  // also held by registrations of ranges inside it
};

// What every UCX request carries for pdlib (ucp_params_t::request_size); the transport's
// RequestContext must fit.
inline constexpr size_t kRequestContextBytes = 16;

struct UcxContext {
  UcpContextPtr handle;  // first: destroyed last, after every mapping below
  std::string key;       // the configuration it was created for (see AcquireUcxContext)
  bool cuda_supported = false;
  // Which transports the context found (ucp_context_print_info's resource list):
  bool rdma_transport = false;  // an RC/DC verbs transport: puts are one-sided RDMA writes
  bool shm_mapping = false;     // posix/sysv: a peer maps memory that UCX allocated and memcpys
  bool xpmem = false;           // xpmem: a peer maps any registered memory
  Mutex mu;
  // Live pools; RegisterMemory reuses their mapping for ranges inside them.
  std::vector<UcxAllocationRecord> allocations ABSL_GUARDED_BY(mu);

  // The mapping of the pool that holds [addr, addr + length), or null.
  std::shared_ptr<UcpMemh> FindAllocation(uintptr_t addr, uint64_t length);
};

// The transport names ("tcp", "posix", "rc_mlx5", ...) in ucp_context_print_info's output: the
// "<tl>/<device>" at the end of each "resource N : ..." line. Pure, for tests.
std::vector<std::string> ParseResourceTransports(std::string_view print_info);

// The context for `options.ucx_config` and the UCX_* environment, created on first use with
// the features every pdlib transport needs (RMA, wakeup). Settings pdlib applies itself but that
// this UCX rejects (UcxDefaults()) are logged and skipped; the user's are errors.
StatusOr<std::shared_ptr<UcxContext>> AcquireUcxContext(const UcxOptions& options);

// A KV pool allocated by UCX in `context` (kFailedPrecondition for CUDA memory when this UCX
// has no CUDA support).
StatusOr<std::unique_ptr<KVPool>> AllocateUcxPool(std::shared_ptr<UcxContext> context,
                                                  uint64_t bytes, MemoryKind kind);

// The allocator AllocateKVPool("ucx", ...) calls: parses `backend_options` like a transport of
// side `mode` does, then allocates in the matching context.
StatusOr<std::unique_ptr<KVPool>> AllocateUcxPoolFor(
    uint64_t bytes, MemoryKind kind, const std::map<std::string, std::string>& backend_options,
    Mode mode);

// Whether [addr, addr + length) lies in a pool of a UCX context other than `context` (a pool
// allocated with other backend options than the transport registering it: it cannot reuse the
// mapping). For a diagnostic only.
bool InForeignUcxPool(const UcxContext& context, uintptr_t addr, uint64_t length);

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_CONTEXT_H_
