#include "backends/cuda_ipc/cuda_ipc_cma.h"

#include <limits.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

Status CmaError(int32_t pid, int err) {
  const std::string what = "cuda_ipc: process_vm_writev into process " + std::to_string(pid) +
                           " failed: " + std::strerror(err);
  switch (err) {
    case ESRCH: return Status::Unavailable(what + " (the target process is gone)");
    case EFAULT:
      return Status::Unavailable(what +
                                 " (a destination is not mapped in the target: it "
                                 "deregistered or freed the region)");
    case EPERM:
      return Status::PermissionDenied(
          what +
          " (writing host regions needs ptrace access to the target: the same user, and "
          "with Yama ptrace_scope 1 the target's PR_SET_PTRACER, which cuda_ipc sets "
          "unless cuda_ipc.ptracer=keep; ptrace_scope 2 or 3 rules it out)");
    default: return Status::Internal(what);
  }
}

}  // namespace

Status WriteProcessMemory(int32_t pid, std::span<const CmaWrite> writes) {
  // Pieces are consumed in order; a partial write leaves `done` bytes of piece `next` written.
  size_t next = 0;
  uint64_t done = 0;
  std::vector<iovec> local, remote;
  while (next < writes.size()) {
    local.clear();
    remote.clear();
    uint64_t asked = 0;
    for (size_t i = next; i < writes.size() && local.size() < IOV_MAX; ++i) {
      const uint64_t skip = i == next ? done : 0;
      const uint64_t bytes = writes[i].bytes - skip;
      if (bytes == 0) continue;
      local.push_back({const_cast<uint8_t*>(static_cast<const uint8_t*>(writes[i].src) + skip),
                       static_cast<size_t>(bytes)});
      remote.push_back({reinterpret_cast<void*>(writes[i].dst + skip), static_cast<size_t>(bytes)});
      asked += bytes;
    }
    if (asked == 0) break;
    const ssize_t n =
        process_vm_writev(pid, local.data(), local.size(), remote.data(), remote.size(), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return CmaError(pid, errno);
    }
    if (n == 0) return CmaError(pid, EFAULT);  // no progress: the next destination is unmapped
    // Advance over what was written.
    auto left = static_cast<uint64_t>(n);
    while (left > 0 && next < writes.size()) {
      const uint64_t rest = writes[next].bytes - done;
      if (left >= rest) {
        left -= rest;
        ++next;
        done = 0;
      } else {
        done += left;
        left = 0;
      }
    }
    while (next < writes.size() && writes[next].bytes == done) {
      ++next;
      done = 0;
    }
  }
  return Status::OK();
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
