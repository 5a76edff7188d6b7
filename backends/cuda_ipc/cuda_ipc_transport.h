// The cuda_ipc backend: prefill writes into decode's memory on the same node, GPU pools through
// CUDA IPC memory handles and host regions (aux and metadata buffers) through
// process_vm_writev. The transport SPI (include/pdlib/spi/transport.h) on the toolkit
// (backends/common); what is here is only the wire. README.md says when to use it.
//
// Keys and endpoints (cuda_ipc_wire.h): a kCuda region's key carries its allocation's
// cudaIpcMemHandle_t and offset, a kHost region's its address; an endpoint blob names the
// target process (pid and start time) and the node (boot id). Connect refuses a peer on another
// node; ImportRemoteRegion opens a CUDA handle once per allocation, shared by every peer and
// region of this transport (IpcMappings), released when the last peer using it disconnects.
//
// A batch (progress thread, cuda_ipc_progress.cc): its host-to-host writes go through
// process_vm_writev at once; its writes into GPU memory go on the transport's own non-blocking
// stream, GPU-to-GPU ones coalesced (copy_plan.h) into one gather kernel launch
// (gather_copy.h; cuda_ipc.copy=memcpy: one cudaMemcpyAsync per descriptor), host-to-GPU ones as
// cudaMemcpyAsync each, then one cudaEventRecord. The batch completes when the event has: no
// write of it can land afterwards. GPU-to-host writes (rare) are copied back to a bounce buffer
// first and then written like host ones.
//
// Reads (PostReads, pull): the same paths the other way round. The key blobs are then the
// target's (prefill's), so the initiator (decode) opens the target's IPC handles and copies from
// its mapping into its own memory: GPU-to-GPU reads go into the gather kernel as well, reads
// into our host memory from the target's GPU memory are cudaMemcpyAsync, host-to-host reads are
// process_vm_readv, and reads of the target's host memory into our GPU memory go through a
// bounce buffer. A read batch completes like a write batch: once its event has, nothing of it
// lands any more.
//
// Fencing: the initiator's GPU writes through its own mappings cannot be cut off by the target,
// so capabilities().fences is false and decode quarantines failed rooms until prefill drains.
//
// Without a usable CUDA device the transport still works for host memory; a kCuda region is
// refused naming cudaGetDeviceCount's error.
//
// Threads: every public method may be called from any thread, including from a completion
// callback (calls made there run inline on the progress thread). Every CUDA call runs on the
// progress thread, whose current device is TransportOptions::device_id; callbacks run there too.
#ifndef PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
#define PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_TRANSPORT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/common/batches.h"
#include "backends/common/progress_thread.h"
#include "backends/common/tables.h"
#include "backends/cuda_ipc/copy_plan.h"
#include "backends/cuda_ipc/cuda_ipc_cuda.h"
#include "backends/cuda_ipc/cuda_ipc_options.h"
#include "backends/cuda_ipc/cuda_ipc_wire.h"
#include "backends/cuda_ipc/digest_kernel.h"
#include "backends/cuda_ipc/gather_copy.h"
#include "lib/base/mutex.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {

// Owned by whoever created it (the KVManager); see the file comment for threads.
class CudaIpcTransport final : public spi::Transport {
 public:
  static StatusOr<std::unique_ptr<CudaIpcTransport>> Create(const spi::TransportOptions& options);
  ~CudaIpcTransport() override;
  CudaIpcTransport(const CudaIpcTransport&) = delete;
  CudaIpcTransport& operator=(const CudaIpcTransport&) = delete;

  std::string_view name() const override { return "cuda_ipc"; }
  spi::TransportCapabilities capabilities() const override;

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              spi::Blob* key_blob) override;
  Status DeregisterMemory(spi::LocalRegionId region) override;
  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override;
  void CloseTargetEndpoint(spi::TargetId target) override;
  StatusOr<spi::Connection> Connect(const spi::Blob& target_endpoint) override;
  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override;
  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override;
  // Copies from the target's memory into ours (see "Reads" in the file comment).
  Status PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                   spi::ReadCallback done) override;
  // Also asks the target process's watch (a dead target fails the peer).
  Status PeerStatus(spi::PeerId peer) override;
  // The KV digest of our GPU regions (capabilities().digests_cuda_memory when a device is
  // usable): one DeviceDigester launch on the progress thread, after the GPU work already on the
  // transport's stream; every range must lie inside one registered kCuda region.
  Status DigestRanges(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs) override;
  void Disconnect(spi::PeerId peer) override;

 private:
  using Clock = std::chrono::steady_clock;
  struct PeerState;

  // How one write or read travels.
  enum class Path : uint8_t {
    // Writes.
    kCma,           // host -> host: process_vm_writev
    kGather,        // device -> device on this transport's device: the batch's gather kernel
    kDeviceCopy,    // device -> device from another device: cudaMemcpyAsync
    kHostToDevice,  // cudaMemcpyAsync from (pageable) host memory
    kDeviceToHost,  // cudaMemcpy into a bounce buffer, then process_vm_writev
    // Reads (kGather and kDeviceCopy serve both: src is then the mapping, dst ours).
    kCmaRead,          // host <- host: process_vm_readv
    kDeviceToOurHost,  // our host memory <- the target's GPU memory: cudaMemcpyAsync
    kHostToOurDevice,  // our GPU memory <- the target's host memory: process_vm_readv into a
                       // bounce buffer, then cudaMemcpyAsync and a stream synchronisation
  };
  // The data flows from src to dst. An address in the target process (the host paths) is the
  // target's; every other address is ours (a GPU region of the target: our mapping of it).
  struct Op {
    uint64_t src = 0;
    uint64_t dst = 0;
    uint64_t bytes = 0;
    Path path = Path::kCma;
  };

  // One PostWrites call; owned by its peer's `batches` from acceptance to completion. Progress
  // thread only.
  struct Batch : toolkit::BatchBase<Batch> {
    std::vector<Op> ops;
    int32_t target_pid = 0;
    PeerState* peer = nullptr;
    cudaEvent_t event = nullptr;  // recorded after its GPU work; null when it has none
  };

  // A registered local region, as PostWrites resolves it.
  struct LocalRegionEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    bool cuda = false;
    int32_t device = 0;
  };
  // An imported region: `addr` is where this process writes it (a CUDA region's address in our
  // mapping of the allocation, a host region's address in the target process).
  struct RemoteRegionEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    bool cuda = false;
  };
  // A connection, as PostWrites validates it.
  struct PeerEntry {
    std::vector<RemoteRegionEntry> regions;
    Status failure;
    ProcessId target;
    bool same_process = false;
    // Asked before every batch (not for a target in this process); shared so that PostWrites can
    // ask it outside mu_.
    std::shared_ptr<const ProcessWatch> watch;
  };
  struct TargetEntry {
    bool fenced = false;  // never set: this transport cannot fence (capabilities().fences)
  };
  // The progress thread's view of one connection.
  struct PeerState {
    spi::PeerId id = 0;
    toolkit::BatchList<Batch> batches;          // outstanding, oldest first
    std::vector<IpcMappings::Handle> mappings;  // one reference each in mappings_
    bool disconnecting = false;
    std::vector<std::promise<void>> on_erased;
  };

  CudaIpcTransport(CudaIpcOptions options, int32_t device);
  Status Init();
  Status Post(spi::PeerId peer, std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              toolkit::OpKind kind);

  // Progress thread (cuda_ipc_progress.cc).
  // Whether RunHostOps moves an op of this path (process_vm_readv/writev, with a bounce buffer
  // where the GPU memory is ours); the others go on the stream.
  static bool IsHostPath(Path path);
  void ProgressLoop();
  bool DrainCommands(bool* stop);
  void AcceptBatch(std::unique_ptr<Batch> owned);
  Status Execute(Batch& batch);
  Status EnqueueDeviceOps(Batch& batch);
  Status RunHostOps(const Batch& batch);
  bool PollEvents();
  void FinishBatch(Batch& batch);
  void DrainPeer(PeerState& peer);
  void ErasePeer(spi::PeerId id);
  void Shutdown();
  StatusOr<cudaEvent_t> TakeEvent();

  const CudaIpcOptions options_;
  const int32_t device_;
  DeviceProbe probe_;    // set by Create, read-only afterwards
  ProcessId self_;       // this process
  std::string boot_id_;  // this node's

  Mutex mu_;
  toolkit::LocalRegions<LocalRegionEntry> local_regions_ ABSL_GUARDED_BY(mu_){"cuda_ipc"};
  toolkit::PeerTable<PeerEntry> peers_ ABSL_GUARDED_BY(mu_){"cuda_ipc"};
  toolkit::TargetTable<TargetEntry> targets_ ABSL_GUARDED_BY(mu_){"cuda_ipc"};
  bool ptracer_set_ ABSL_GUARDED_BY(mu_) = false;

  // Progress thread only.
  std::unordered_map<spi::PeerId, std::unique_ptr<PeerState>> peer_states_;
  std::deque<Batch*> gpu_pending_;  // batches whose event is recorded, in stream order
  std::vector<cudaEvent_t> free_events_;
  std::optional<CudaStream> stream_;  // created on the progress thread when a device is usable
  std::unique_ptr<GatherCopier> copier_;
  std::unique_ptr<DeviceDigester> digester_;  // created by the first DigestRanges
  IpcMappings mappings_;
  std::vector<ResolvedCopy> copies_;  // scratch for one batch
  std::vector<CopyDesc> descs_;
  std::vector<uint8_t> bounce_;
  toolkit::Completions<Batch> completions_;
  uint64_t last_seq_ = 0;

  toolkit::ProgressThread<Batch> progress_{"cuda_ipc"};  // last: stopped first
};

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_CUDA_IPC_CUDA_IPC_TRANSPORT_H_
