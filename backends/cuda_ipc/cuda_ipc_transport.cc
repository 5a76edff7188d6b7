// The cuda_ipc transport's API side: setup, blobs, validation and hand-over to the progress
// thread (whose side lives in cuda_ipc_progress.cc).
#include "backends/cuda_ipc/cuda_ipc_transport.h"

#include <sys/prctl.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/registry/builtin_registration.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

CudaIpcTransport::CudaIpcTransport(CudaIpcOptions options, int32_t device)
    : options_(options), device_(device) {}

StatusOr<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::Create(
    const spi::TransportOptions& options) {
  auto parsed = ParseCudaIpcOptions(options.options);
  if (!parsed.ok()) return parsed.status();
  if (options.device_id < 0) {
    return Status::InvalidArgument("cuda_ipc: device_id " + std::to_string(options.device_id) +
                                   " is negative");
  }
  std::unique_ptr<CudaIpcTransport> transport(new CudaIpcTransport(*parsed, options.device_id));
  if (Status s = transport->Init(); !s.ok()) return s;
  return transport;
}

Status CudaIpcTransport::Init() {
  auto boot = ReadBootId();
  if (!boot.ok()) return boot.status();
  boot_id_ = *boot;
  auto self = SelfProcessId();
  if (!self.ok()) return self.status();
  self_ = *self;
  probe_ = ProbeDevices();
  if (probe_.count > 0 && device_ >= probe_.count) {
    return Status::InvalidArgument("cuda_ipc: device_id " + std::to_string(device_) +
                                   " out of range: this process sees " +
                                   std::to_string(probe_.count) + " CUDA devices");
  }
  if (Status s = progress_.Open({}); !s.ok()) return s;
  progress_.Start([this] { ProgressLoop(); });
  if (probe_.count == 0) {
    PDLIB_LOG(kInfo, "cuda_ipc: no CUDA device (%s): host memory only", probe_.why_none.ToString());
    return Status::OK();
  }
  // The stream and the copier belong to the progress thread, whose current device is device_.
  return progress_.Run<Status>([this]() -> Status {
    CudaStream& stream = stream_.emplace();
    if (Status s = stream.Create(); !s.ok()) return s;
    if (options_.copy == CopyMode::kKernel) {
      auto copier = GatherCopier::Create(device_);
      if (!copier.ok()) return copier.status();
      copier_ = std::move(*copier);
    }
    return Status::OK();
  });
}

CudaIpcTransport::~CudaIpcTransport() {
  progress_.Stop();  // Shutdown: waits for every event, then cancels what is outstanding
  progress_.ClearCommands();
  MutexLock lock(&mu_);
  peers_.Clear();
  local_regions_.Clear();
}

spi::TransportCapabilities CudaIpcTransport::capabilities() const {
  spi::TransportCapabilities caps;
  caps.moves_bytes = true;
  caps.needs_reply = false;
  caps.supports_cuda_memory = probe_.count > 0;
  caps.reads = true;    // the same paths the other way round (process_vm_readv for host memory)
  caps.fences = false;  // the initiator writes through its own mappings (file comment)
  caps.digests_cuda_memory = probe_.count > 0;  // DeviceDigester (digest_kernel.h)
  return caps;
}

Status CudaIpcTransport::DigestRanges(std::span<const spi::DigestRange> ranges,
                                      std::span<uint32_t> crcs) {
  if (crcs.size() < ranges.size()) {
    return Status::InvalidArgument("cuda_ipc: DigestRanges with fewer CRCs than ranges");
  }
  {
    MutexLock lock(&mu_);
    for (const spi::DigestRange& r : ranges) {
      const LocalRegionEntry* e = local_regions_.Holding(r.addr, r.length);
      if (e == nullptr || !e->cuda) {
        return Status::InvalidArgument(absl::StrFormat(
            "cuda_ipc: DigestRanges: [%#x, +%d) is not inside a registered CUDA region", r.addr,
            r.length));
      }
    }
  }
  return progress_.Run<Status>([&]() -> Status {
    if (digester_ == nullptr) {
      auto created = DeviceDigester::Create(device_);
      if (!created.ok()) return created.status().WithPrefix("cuda_ipc: the digest kernel");
      digester_ = std::move(created).value();
    }
    // After the writes and reads already on our stream (a pull's reads into these pages).
    return digester_->Digest(ranges, crcs, stream_ ? stream_->get() : nullptr);
  });
}

StatusOr<spi::LocalRegionId> CudaIpcTransport::RegisterMemory(const spi::MemoryRegion& region,
                                                              spi::Blob* key_blob) {
  if (region.addr == nullptr || region.length == 0) {
    return Status::InvalidArgument("cuda_ipc: cannot register an empty region");
  }
  const auto addr = reinterpret_cast<uint64_t>(region.addr);
  if (addr + region.length < addr) return Status::InvalidArgument("cuda_ipc: region wraps around");
  KeyInfo key;
  key.length = region.length;
  key.address = addr;
  key.device = region.device_id;
  LocalRegionEntry entry{addr, region.length, false, region.device_id};
  if (region.kind == MemoryKind::kCuda) {
    if (probe_.count == 0) {
      return Status::FailedPrecondition(
          "cuda_ipc: cannot register memory of kind " + std::string(MemoryKindName(region.kind)) +
          ": no usable CUDA device in this process (" + probe_.why_none.ToString() + ")");
    }
    auto described = progress_.Run<Status>([&]() -> Status {
      cudaPointerAttributes attributes{};
      cudaError_t error = cudaPointerGetAttributes(&attributes, region.addr);
      if (error != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
        cudaGetLastError();
        return error != cudaSuccess
                   ? CudaError("cudaPointerGetAttributes", error, "registering a kCuda region")
                   : Status::InvalidArgument(
                         "cuda_ipc: a kCuda region must be device memory (cudaMalloc); this one "
                         "is of CUDA memory type " +
                         std::to_string(static_cast<int>(attributes.type)));
      }
      auto range = FindAllocation(addr);
      if (!range.ok()) return range.status();
      if (addr - range->base > range->size || region.length > range->size - (addr - range->base)) {
        return Status::InvalidArgument("cuda_ipc: region of " + std::to_string(region.length) +
                                       " bytes runs past the end of its CUDA allocation");
      }
      cudaIpcMemHandle_t handle;
      error = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(range->base));
      if (error != cudaSuccess) {
        cudaGetLastError();
        return CudaError("cudaIpcGetMemHandle", error,
                         "the allocation must come from cudaMalloc, not a memory pool or VMM");
      }
      std::memcpy(key.handle.data(), &handle, sizeof(handle));
      key.kind = KeyKind::kCuda;
      key.offset = addr - range->base;
      key.device = attributes.device;
      return Status::OK();
    });
    if (!described.ok()) return described;
    entry.cuda = true;
    entry.device = key.device;
  }
  if (key_blob != nullptr) *key_blob = EncodeKey(key);
  MutexLock lock(&mu_);
  return local_regions_.Add(entry);
}

Status CudaIpcTransport::DeregisterMemory(spi::LocalRegionId region) {
  {
    MutexLock lock(&mu_);
    auto removed = local_regions_.Remove(region);
    if (!removed.ok()) return removed.status();
  }
  // Batches accepted before this point may still read the region: wait until they are done, as
  // the caller frees the memory next. A call from a completion callback cannot wait for itself.
  if (progress_.OnThread()) return Status::OK();
  return progress_.Run<Status>([this] {
    if (!gpu_pending_.empty() && gpu_pending_.back()->event != nullptr) {
      cudaEventSynchronize(gpu_pending_.back()->event);
    }
    return Status::OK();
  });
}

StatusOr<spi::TargetEndpoint> CudaIpcTransport::CreateTargetEndpoint() {
  MutexLock lock(&mu_);
  if (options_.ptracer == Ptracer::kAny && !ptracer_set_) {
    // Under Yama ptrace_scope 1 only an ancestor may write our host regions with
    // process_vm_writev unless we allow it; EINVAL means no Yama (nothing to allow).
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0 && errno != EINVAL) {
      PDLIB_LOG(kWarning,
                "cuda_ipc: prctl(PR_SET_PTRACER_ANY) failed: %s; initiators may be refused "
                "writing host regions",
                std::strerror(errno));
    }
    ptracer_set_ = true;
  }
  const spi::TargetId id = targets_.Add(TargetEntry{});
  return spi::TargetEndpoint{id, EncodeEndpoint(EndpointInfo{id, self_, boot_id_})};
}

void CudaIpcTransport::CloseTargetEndpoint(spi::TargetId target) {
  MutexLock lock(&mu_);
  targets_.Take(target);
}

StatusOr<spi::Connection> CudaIpcTransport::Connect(const spi::Blob& target_endpoint) {
  auto info = DecodeEndpoint(target_endpoint);
  if (!info.ok()) return info.status();
  if (info->boot_id != boot_id_) {
    return Status::FailedPrecondition(
        "cuda_ipc: the target runs on another node (boot id " + info->boot_id + ", ours " +
        boot_id_ + "); cuda_ipc connects processes on one node: use ucx or verbs across nodes");
  }
  const bool same_process = info->process.pid == self_.pid;
  if (same_process && info->process.start_time != self_.start_time) {
    return Status::Unavailable("cuda_ipc: target process " + std::to_string(info->process.pid) +
                               " exited (its pid now names this process)");
  }
  std::shared_ptr<const ProcessWatch> watch;
  if (!same_process) {
    auto opened = ProcessWatch::Open(info->process);
    if (!opened.ok()) return opened.status();
    watch = std::move(*opened);
  }
  spi::PeerId id = 0;
  {
    MutexLock lock(&mu_);
    id = peers_.NextId();
  }
  Status added = progress_.Run<Status>([&] {
    auto state = std::make_unique<PeerState>();
    state->id = id;
    peer_states_.emplace(id, std::move(state));
    MutexLock lock(&mu_);
    peers_.Add(id, PeerEntry{{}, Status(), info->process, same_process, watch});
    return Status::OK();
  });
  if (!added.ok()) return added;
  return spi::Connection{id, {}};
}

StatusOr<spi::RemoteRegionId> CudaIpcTransport::ImportRemoteRegion(
    spi::PeerId peer, const spi::RemoteRegion& region) {
  auto key = DecodeKey(region.key);
  if (!key.ok()) return key.status();
  if (Status s = toolkit::CheckRemoteRegion("cuda_ipc", region); !s.ok()) return s;
  // The region must lie inside the one the key describes.
  if (region.addr < key->address || region.addr - key->address > key->length ||
      region.length > key->length - (region.addr - key->address)) {
    return Status::InvalidArgument(
        "cuda_ipc: remote region [" + std::to_string(region.addr) + ", +" +
        std::to_string(region.length) + ") is not inside the registered region [" +
        std::to_string(key->address) + ", +" + std::to_string(key->length) + ") its key names");
  }
  bool same_process = false;
  {
    MutexLock lock(&mu_);
    auto entry = peers_.ForImport(peer);
    if (!entry.ok()) return entry.status();
    same_process = (*entry)->same_process;
  }
  RemoteRegionEntry remote{region.addr, region.length, key->kind == KeyKind::kCuda};
  if (remote.cuda && probe_.count == 0) {
    return Status::FailedPrecondition(
        "cuda_ipc: cannot import the peer's memory of kind cuda: no usable CUDA device in this "
        "process (" +
        probe_.why_none.ToString() + ")");
  }
  if (remote.cuda && !same_process) {
    // Opened on the progress thread (its current device), once per allocation.
    auto mapped = progress_.Run<StatusOr<uint64_t>>([&]() -> StatusOr<uint64_t> {
      auto it = peer_states_.find(peer);
      if (it == peer_states_.end()) {
        return Status::NotFound("cuda_ipc: peer " + std::to_string(peer) + " is disconnected");
      }
      uint64_t size = 0;
      auto base = mappings_.Open(key->handle, &size);
      if (!base.ok()) return base.status();
      const uint64_t offset = key->offset + (region.addr - key->address);
      if (offset > size || region.length > size - offset) {
        mappings_.Release(key->handle);
        return Status::InvalidArgument(
            "cuda_ipc: the peer's region (offset " + std::to_string(offset) + ", " +
            std::to_string(region.length) + " bytes) runs past its CUDA allocation of " +
            std::to_string(size) + " bytes");
      }
      it->second->mappings.push_back(key->handle);
      return *base + offset;
    });
    if (!mapped.ok()) return mapped.status();
    remote.addr = *mapped;
  }
  // Same process: a CUDA region's own address is ours (CUDA refuses to open our own handles);
  // host regions are written at the target's address either way.
  MutexLock lock(&mu_);
  PeerEntry* entry = peers_.Find(peer);
  if (entry == nullptr) return Status::NotFound("cuda_ipc: peer " + std::to_string(peer) + " left");
  entry->regions.push_back(remote);
  return static_cast<spi::RemoteRegionId>(entry->regions.size() - 1);
}

Status CudaIpcTransport::PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                                    spi::WriteCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite);
}

Status CudaIpcTransport::PeerStatus(spi::PeerId peer) {
  std::shared_ptr<const ProcessWatch> watch;
  {
    MutexLock lock(&mu_);
    auto found = peers_.ForWrites(peer);
    if (!found.ok()) return found.status();
    watch = (*found)->watch;
  }
  if (watch == nullptr) return Status::OK();
  Status alive = watch->Check();  // outside mu_: it may read /proc
  if (!alive.ok()) {
    MutexLock lock(&mu_);
    peers_.MarkFailed(peer, alive);
  }
  return alive;
}

Status CudaIpcTransport::PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                                   spi::ReadCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kRead);
}

Status CudaIpcTransport::Post(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                              spi::WriteCallback done, toolkit::OpKind kind) {
  const bool reads = kind == toolkit::OpKind::kRead;
  auto batch = std::make_unique<Batch>();
  batch->peer_id = peer;
  batch->done = std::move(done);
  batch->ops.reserve(ops.size());
  if (Status s = PeerStatus(peer); !s.ok()) return s;
  MutexLock lock(&mu_);
  auto found = peers_.ForWrites(peer);  // again: a Disconnect may have come in between
  if (!found.ok()) return found.status();
  batch->target_pid = (*found)->target.pid;
  for (size_t i = 0; i < ops.size(); ++i) {
    const spi::WriteOp& op = ops[i];
    auto resolved = peers_.ResolveWrite(peer, **found, local_regions_, i, op, kind);
    if (!resolved.ok()) return resolved.status();
    if (op.length == 0) continue;
    const LocalRegionEntry& local = *resolved->first;
    const RemoteRegionEntry& remote = *resolved->second;
    const uint64_t ours = local.addr + op.local_offset;
    const uint64_t theirs = remote.addr + op.remote_offset;
    Path path = Path::kCma;
    if (remote.cuda && local.cuda) {
      path = local.device == device_ ? Path::kGather : Path::kDeviceCopy;
    } else if (remote.cuda) {
      path = reads ? Path::kDeviceToOurHost : Path::kHostToDevice;
    } else if (local.cuda) {
      path = reads ? Path::kHostToOurDevice : Path::kDeviceToHost;
    } else {
      path = reads ? Path::kCmaRead : Path::kCma;
    }
    batch->ops.push_back(reads ? Op{theirs, ours, op.length, path}
                               : Op{ours, theirs, op.length, path});
  }
  // Under mu_: a Disconnect of the peer (which takes mu_ first) is queued after it.
  if (!progress_.Enqueue({std::move(batch), {}})) {
    return Status::Cancelled("cuda_ipc: the transport is shutting down");
  }
  return Status::OK();
}

void CudaIpcTransport::Disconnect(spi::PeerId peer) {
  {
    MutexLock lock(&mu_);
    if (!peers_.Erase(peer)) return;
  }
  std::promise<void> erased;
  std::future<void> erased_future = erased.get_future();
  auto start = [this, peer, &erased] {
    auto it = peer_states_.find(peer);
    if (it == peer_states_.end()) {
      erased.set_value();
      return;
    }
    it->second->disconnecting = true;
    it->second->on_erased.push_back(std::move(erased));
    DrainPeer(*it->second);
  };
  if (progress_.OnThread()) {  // from a completion callback: cannot wait for ourselves
    start();
    return;
  }
  if (!progress_.Post(start)) return;  // shutting down: the destructor cancels all
  erased_future.wait();
}

}  // namespace cuda_ipc

void RegisterCudaIpcBackend() {
  internal::RegisterBuiltinTransport(
      "cuda_ipc",
      [](const spi::TransportOptions& options) -> StatusOr<std::unique_ptr<spi::Transport>> {
        auto transport = cuda_ipc::CudaIpcTransport::Create(options);
        if (!transport.ok()) return transport.status();
        return std::unique_ptr<spi::Transport>(std::move(*transport));
      })
      .IgnoreError();  // only fails if "cuda_ipc" is registered twice, which call_once prevents
}

}  // namespace v1
}  // namespace pdlib
