#include "backends/cuda_ipc/cuda_ipc_wire.h"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

// Endpoint: magic, version, target (8), pid (4), reserved (4), start time (8), boot id (36).
constexpr size_t kEndpointBytes = 4 + 4 + 8 + 4 + 4 + 8 + kBootIdBytes;
// Key: magic, version, kind (4), device (4), length (8), address (8), then for cuda keys:
// offset (8), handle (64).
constexpr size_t kKeyHeader = 4 + 4 + 4 + 4 + 8 + 8;
constexpr size_t kHostKeyBytes = kKeyHeader;
constexpr size_t kCudaKeyBytes = kKeyHeader + 8 + kIpcHandleBytes;

// Appends and reads fixed-size fields in host byte order.
class Writer {
 public:
  template <typename T>
  Writer& Put(const T& value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    blob_.insert(blob_.end(), p, p + sizeof(T));
    return *this;
  }
  Writer& PutBytes(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    blob_.insert(blob_.end(), p, p + size);
    return *this;
  }
  spi::Blob Take() { return std::move(blob_); }

 private:
  spi::Blob blob_;
};

class Reader {
 public:
  explicit Reader(const spi::Blob& blob) : blob_(blob) {}
  template <typename T>
  T Get() {
    T value{};
    std::memcpy(&value, blob_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  void GetBytes(void* out, size_t size) {
    std::memcpy(out, blob_.data() + pos_, size);
    pos_ += size;
  }

 private:
  const spi::Blob& blob_;
  size_t pos_ = 0;
};

// Checks the magic and version; the caller checks the size of what follows.
Status CheckHeader(const spi::Blob& blob, uint32_t magic, const char* what) {
  if (blob.size() < 8) {
    return Status::InvalidArgument(std::string("cuda_ipc: ") + what + " blob of " +
                                   std::to_string(blob.size()) + " bytes is truncated");
  }
  Reader r(blob);
  const auto got_magic = r.Get<uint32_t>();
  const auto version = r.Get<uint32_t>();
  if (got_magic != magic) {
    return Status::InvalidArgument(std::string("cuda_ipc: blob is not a cuda_ipc ") + what +
                                   " (made by another backend?)");
  }
  if (version != kWireVersion) {
    return Status::InvalidArgument(std::string("cuda_ipc: ") + what + " blob has version " +
                                   std::to_string(version) + ", this pdlib reads version " +
                                   std::to_string(kWireVersion));
  }
  return Status::OK();
}

Status WrongSize(const char* what, size_t got, size_t want) {
  return Status::InvalidArgument(std::string("cuda_ipc: ") + what + " blob of " +
                                 std::to_string(got) + " bytes, expected " + std::to_string(want));
}

}  // namespace

spi::Blob EncodeEndpoint(const EndpointInfo& info) {
  Writer w;
  w.Put(kEndpointMagic).Put(kWireVersion).Put(info.target).Put(info.process.pid);
  w.Put(uint32_t{0}).Put(info.process.start_time);
  char boot[kBootIdBytes] = {};
  std::memcpy(boot, info.boot_id.data(), std::min(info.boot_id.size(), kBootIdBytes));
  w.PutBytes(boot, kBootIdBytes);
  return w.Take();
}

StatusOr<EndpointInfo> DecodeEndpoint(const spi::Blob& blob) {
  if (Status s = CheckHeader(blob, kEndpointMagic, "endpoint"); !s.ok()) return s;
  if (blob.size() != kEndpointBytes) return WrongSize("endpoint", blob.size(), kEndpointBytes);
  Reader r(blob);
  r.Get<uint64_t>();  // magic and version
  EndpointInfo info;
  info.target = r.Get<uint64_t>();
  info.process.pid = r.Get<int32_t>();
  r.Get<uint32_t>();
  info.process.start_time = r.Get<uint64_t>();
  info.boot_id.resize(kBootIdBytes);
  r.GetBytes(info.boot_id.data(), kBootIdBytes);
  if (info.process.pid <= 0) {
    return Status::InvalidArgument("cuda_ipc: endpoint blob names pid " +
                                   std::to_string(info.process.pid));
  }
  return info;
}

spi::Blob EncodeKey(const KeyInfo& info) {
  Writer w;
  w.Put(kKeyMagic).Put(kWireVersion).Put(static_cast<uint32_t>(info.kind)).Put(info.device);
  w.Put(info.length).Put(info.address);
  if (info.kind == KeyKind::kCuda)
    w.Put(info.offset).PutBytes(info.handle.data(), info.handle.size());
  return w.Take();
}

StatusOr<KeyInfo> DecodeKey(const spi::Blob& blob) {
  if (Status s = CheckHeader(blob, kKeyMagic, "remote key"); !s.ok()) return s;
  if (blob.size() < kKeyHeader) return WrongSize("remote key", blob.size(), kKeyHeader);
  Reader r(blob);
  r.Get<uint64_t>();
  KeyInfo info;
  const auto kind = r.Get<uint32_t>();
  info.device = r.Get<int32_t>();
  info.length = r.Get<uint64_t>();
  info.address = r.Get<uint64_t>();
  if (kind == static_cast<uint32_t>(KeyKind::kHost)) {
    if (blob.size() != kHostKeyBytes) return WrongSize("host key", blob.size(), kHostKeyBytes);
    info.kind = KeyKind::kHost;
  } else if (kind == static_cast<uint32_t>(KeyKind::kCuda)) {
    if (blob.size() != kCudaKeyBytes) return WrongSize("cuda key", blob.size(), kCudaKeyBytes);
    info.kind = KeyKind::kCuda;
    info.offset = r.Get<uint64_t>();
    r.GetBytes(info.handle.data(), info.handle.size());
    if (info.device < 0) {
      return Status::InvalidArgument("cuda_ipc: cuda key names device " +
                                     std::to_string(info.device));
    }
  } else {
    return Status::InvalidArgument("cuda_ipc: remote key has unknown memory kind " +
                                   std::to_string(kind));
  }
  if (info.length == 0) return Status::InvalidArgument("cuda_ipc: remote key of an empty region");
  if (info.address + info.length < info.address) {
    return Status::InvalidArgument("cuda_ipc: remote key's region wraps around");
  }
  return info;
}

StatusOr<std::string> ReadBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id) || id.size() != kBootIdBytes) {
    return Status::FailedPrecondition(
        "cuda_ipc: cannot read this node's boot id from /proc/sys/kernel/random/boot_id (needed "
        "to tell that a peer is on the same node)");
  }
  return id;
}

StatusOr<uint64_t> ReadProcessStartTime(int32_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) {
    return Status::NotFound("cuda_ipc: process " + std::to_string(pid) + " does not exist (" +
                            path + " unreadable)");
  }
  // Field 2 (comm) is in parentheses and may hold spaces: count fields after its last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) {
    return Status::Internal("cuda_ipc: cannot parse " + path);
  }
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  // After ')' come fields 3 (state) .. 22 (starttime): skip 19, read the 20th.
  for (int i = 0; i < 19 && (fields >> field); ++i) {
  }
  uint64_t start = 0;
  if (!(fields >> start)) return Status::Internal("cuda_ipc: cannot parse field 22 of " + path);
  return start;
}

StatusOr<ProcessId> SelfProcessId() {
  const auto pid = static_cast<int32_t>(getpid());
  auto start = ReadProcessStartTime(pid);
  if (!start.ok()) return start.status();
  return ProcessId{pid, *start};
}

Status CheckProcessAlive(const ProcessId& process) {
  auto start = ReadProcessStartTime(process.pid);
  if (!start.ok() || *start != process.start_time) {
    return Status::Unavailable(
        "cuda_ipc: target process " + std::to_string(process.pid) +
        (start.ok() ? " exited (its pid now names another process)" : " exited"));
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<ProcessWatch>> ProcessWatch::Open(const ProcessId& process) {
  std::unique_ptr<ProcessWatch> watch(new ProcessWatch(process));
#if defined(SYS_pidfd_open)
  // Opened first, checked second: if the pid was reused before the open, the start time read
  // now is the newcomer's and the check fails; if it matches, the fd is the target's.
  watch->fd_ = static_cast<int>(::syscall(SYS_pidfd_open, process.pid, 0));
#endif
  if (Status s = CheckProcessAlive(process); !s.ok()) return s;
  return watch;
}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) ::close(fd_);
}

Status ProcessWatch::Check() const {
  if (fd_ < 0) return CheckProcessAlive(process_);
  pollfd p{fd_, POLLIN, 0};
  const int n = ::poll(&p, 1, 0);
  if (n == 0) return Status::OK();
  if (n > 0) {
    return Status::Unavailable("cuda_ipc: target process " + std::to_string(process_.pid) +
                               " exited");
  }
  return CheckProcessAlive(process_);  // poll failed (EINTR, ...): ask /proc instead
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
