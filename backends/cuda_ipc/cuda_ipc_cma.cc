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

Status CmaError(int32_t pid, int err, bool read) {
  const std::string what = std::string("cuda_ipc: ") +
                           (read ? "process_vm_readv from" : "process_vm_writev into") +
                           " process " + std::to_string(pid) + " failed: " + std::strerror(err);
  switch (err) {
    case ESRCH: return Status::Unavailable(what + " (the target process is gone)");
    case EFAULT:
      return Status::Unavailable(what + (read ? " (a source is not mapped in the target: it "
                                                "deregistered or freed the region)"
                                              : " (a destination is not mapped in the target: it "
                                                "deregistered or freed the region)"));
    case EPERM:
      return Status::PermissionDenied(
          what +
          " (reaching host regions needs ptrace access to the target: the same user, and "
          "with Yama ptrace_scope 1 the target's PR_SET_PTRACER, which cuda_ipc sets "
          "unless cuda_ipc.ptracer=keep; ptrace_scope 2 or 3 rules it out)");
    default: return Status::Internal(what);
  }
}

// One piece of either direction: our address and the target's.
struct Piece {
  uint8_t* ours;
  uint64_t theirs;
  uint64_t bytes;
};

// Moves every piece, IOV_MAX per system call, resuming after partial transfers. Pieces are
// consumed in order; a partial call leaves `done` bytes of piece `next` moved.
template <typename GetPiece>
Status Transfer(int32_t pid, size_t count, GetPiece piece, bool read) {
  size_t next = 0;
  uint64_t done = 0;
  std::vector<iovec> local, remote;
  while (next < count) {
    local.clear();
    remote.clear();
    uint64_t asked = 0;
    for (size_t i = next; i < count && local.size() < IOV_MAX; ++i) {
      const Piece p = piece(i);
      const uint64_t skip = i == next ? done : 0;
      const uint64_t bytes = p.bytes - skip;
      if (bytes == 0) continue;
      local.push_back({p.ours + skip, static_cast<size_t>(bytes)});
      remote.push_back({reinterpret_cast<void*>(p.theirs + skip), static_cast<size_t>(bytes)});
      asked += bytes;
    }
    if (asked == 0) break;
    const ssize_t n =
        read ? process_vm_readv(pid, local.data(), local.size(), remote.data(), remote.size(), 0)
             : process_vm_writev(pid, local.data(), local.size(), remote.data(), remote.size(), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return CmaError(pid, errno, read);
    }
    if (n == 0) return CmaError(pid, EFAULT, read);  // no progress: the next piece is unmapped
    // Advance over what was moved.
    auto left = static_cast<uint64_t>(n);
    while (left > 0 && next < count) {
      const uint64_t rest = piece(next).bytes - done;
      if (left >= rest) {
        left -= rest;
        ++next;
        done = 0;
      } else {
        done += left;
        left = 0;
      }
    }
    while (next < count && piece(next).bytes == done) {
      ++next;
      done = 0;
    }
  }
  return Status::OK();
}

}  // namespace

Status WriteProcessMemory(int32_t pid, std::span<const CmaWrite> writes) {
  return Transfer(
      pid, writes.size(),
      [&](size_t i) {
        return Piece{const_cast<uint8_t*>(static_cast<const uint8_t*>(writes[i].src)),
                     writes[i].dst, writes[i].bytes};
      },
      /*read=*/false);
}

Status ReadProcessMemory(int32_t pid, std::span<const CmaRead> reads) {
  return Transfer(
      pid, reads.size(),
      [&](size_t i) {
        return Piece{static_cast<uint8_t*>(reads[i].dst), reads[i].src, reads[i].bytes};
      },
      /*read=*/true);
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
