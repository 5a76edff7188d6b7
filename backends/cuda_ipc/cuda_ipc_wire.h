// The cuda_ipc backend's wire: what its blobs carry and how a process on this node is named.
// Pure C++ (no CUDA types: an IPC handle travels as its 64 opaque bytes), so it is unit-tested
// without a GPU.
//
// Endpoint blob (CreateTargetEndpoint -> Connect): magic, version, target id, the target's pid
// and its start time (/proc/<pid>/stat field 22, so that a reused pid is not taken for the
// target), and the node's boot id (/proc/sys/kernel/random/boot_id): cuda_ipc only connects
// processes of one node, and two nodes never share a boot id.
// Key blob (RegisterMemory -> ImportRemoteRegion), one of two kinds:
//   host: the region's address and length (written with process_vm_writev into the target);
//   cuda: the region's address and length in the target, the allocation's cudaIpcMemHandle_t,
//         the region's offset from the allocation's base and the device id (the initiator
//         opens the handle once per allocation; a target in the same process is written
//         through the address itself, as CUDA cannot open a process's own handles).
// Every field is host byte order: both ends are on one node.
#ifndef PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_WIRE_H_
#define PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_WIRE_H_

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

inline constexpr uint32_t kEndpointMagic = 0x45434450;  // "PDCE"
inline constexpr uint32_t kKeyMagic = 0x4b434450;       // "PDCK"
inline constexpr uint32_t kWireVersion = 1;
inline constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
inline constexpr size_t kBootIdBytes = 36;     // "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"

// A process on this node, as another process can check it is still the same one.
struct ProcessId {
  int32_t pid = 0;
  uint64_t start_time = 0;  // clock ticks after boot (/proc/<pid>/stat field 22)
};

struct EndpointInfo {
  spi::TargetId target = 0;
  ProcessId process;
  std::string boot_id;  // kBootIdBytes characters
};

enum class KeyKind : uint32_t { kHost = 1, kCuda = 2 };

struct KeyInfo {
  KeyKind kind = KeyKind::kHost;
  uint64_t length = 0;
  uint64_t address = 0;  // the region's address in the target process (both kinds)
  // kCuda: the allocation's handle, the region's offset from the allocation's base, its device.
  std::array<uint8_t, kIpcHandleBytes> handle{};
  uint64_t offset = 0;
  int32_t device = 0;
};

spi::Blob EncodeEndpoint(const EndpointInfo& info);
// InvalidArgument naming what is wrong: truncated, another backend's, another version.
StatusOr<EndpointInfo> DecodeEndpoint(const spi::Blob& blob);

spi::Blob EncodeKey(const KeyInfo& info);
StatusOr<KeyInfo> DecodeKey(const spi::Blob& blob);

// This node's boot id (kBootIdBytes characters), or why it cannot be read.
StatusOr<std::string> ReadBootId();
// `pid`'s start time from /proc/<pid>/stat; NotFound when no such process exists.
StatusOr<uint64_t> ReadProcessStartTime(int32_t pid);
// This process.
StatusOr<ProcessId> SelfProcessId();
// Whether `process` still runs (same pid, same start time); Unavailable naming the pid if not.
Status CheckProcessAlive(const ProcessId& process);

// Watches one target process for PostWrites, which asks before every batch. Where the kernel has
// pidfd_open (Linux >= 5.3) the watch holds a pidfd opened before the start time was checked, so
// a check is one poll() that no reused pid can fool and that sees a zombie as gone; elsewhere it
// reads /proc/<pid>/stat each time (CheckProcessAlive).
class ProcessWatch {
 public:
  // Unavailable (as CheckProcessAlive) when `process` no longer runs.
  static StatusOr<std::unique_ptr<ProcessWatch>> Open(const ProcessId& process);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  Status Check() const;
  bool uses_pidfd() const { return fd_ >= 0; }

 private:
  explicit ProcessWatch(const ProcessId& process) : process_(process) {}
  ProcessId process_;
  int fd_ = -1;
};

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_WIRE_H_
