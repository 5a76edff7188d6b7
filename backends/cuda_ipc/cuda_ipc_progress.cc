// The cuda_ipc transport's progress thread: the only thread that calls CUDA for the transport.
// It accepts batches, writes their host regions with process_vm_writev, issues their GPU writes
// on the transport's stream followed by an event, completes each batch once its event has, and
// runs the callbacks.
//
// Waiting for events: a CUDA event has no file descriptor to sleep on. The loop polls the
// oldest outstanding event (events on one stream complete in order) with cudaEventQuery,
// yielding the core, for a short while after the last progress, then sleeps in 1 ms steps
// until it completes. cudaLaunchHostFunc could write the wake fd instead, but a host function
// runs on a CUDA-internal thread and stalls the stream behind it until it returns, a cost on
// every batch for a saving only on long transfers, where a 1 ms step is small anyway.
#include <sched.h>
#include <sys/epoll.h>

#include "backends/cuda_ipc/cuda_ipc_cma.h"
#include "backends/cuda_ipc/cuda_ipc_transport.h"
#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

constexpr auto kPendingPollFor = std::chrono::milliseconds(2);
constexpr int kPendingSleepMs = 1;
constexpr int kIdleSleepMs = 100;
// cudaMemcpy2DAsync takes pitches below the device's maximum pitch (2^31 - 1 on current GPUs);
// longer strides are copied piece by piece.
constexpr uint64_t kMaxPitch = (uint64_t{1} << 31) - 1;

}  // namespace

void CudaIpcTransport::ProgressLoop() {
  if (probe_.count > 0) {
    if (cudaError_t error = cudaSetDevice(device_); error != cudaSuccess) {
      PDLIB_LOG(kWarning, "%s", CudaError("cudaSetDevice", error).ToString());
    }
  }
  toolkit::IdlePolicy idle(std::chrono::microseconds(options_.busy_poll_us));
  epoll_event events[2];
  while (true) {
    const Clock::time_point now = Clock::now();
    bool stop = false;
    bool worked = DrainCommands(&stop);
    if (stop) break;
    worked |= PollEvents();
    if (!completions_.empty()) {
      completions_.Run();
      worked = true;
    }
    if (!idle.ShouldSleep(now, worked)) continue;
    if (gpu_pending_.empty()) {
      progress_.Sleep(kIdleSleepMs, events);
    } else if (now - idle.last_work() < kPendingPollFor) {
      sched_yield();
    } else {
      progress_.Sleep(kPendingSleepMs, events);
    }
  }
  Shutdown();
}

bool CudaIpcTransport::DrainCommands(bool* stop) {
  const bool ran =
      progress_.RunCommands([this](std::unique_ptr<Batch> b) { AcceptBatch(std::move(b)); }, stop);
  if (ran) completions_.Run();
  return ran;
}

void CudaIpcTransport::AcceptBatch(std::unique_ptr<Batch> owned) {
  owned->seq = ++last_seq_;
  auto it = peer_states_.find(owned->peer_id);
  if (it == peer_states_.end() || it->second->disconnecting) {
    owned->Fail(Status::Cancelled("cuda_ipc: peer " + std::to_string(owned->peer_id) +
                                  " was disconnected"));
    completions_.Add(std::move(owned));
    return;
  }
  PeerState& peer = *it->second;
  owned->peer = &peer;
  Batch& batch = peer.batches.Add(std::move(owned));
  if (Status s = Execute(batch); !s.ok()) {
    batch.Fail(s);
    if (s.code() == StatusCode::kUnavailable) {
      MutexLock lock(&mu_);
      peers_.MarkFailed(peer.id, s);  // the target is gone: refuse new batches up front
    }
  }
  if (batch.event != nullptr) {
    gpu_pending_.push_back(&batch);
  } else {
    FinishBatch(batch);
  }
}

bool CudaIpcTransport::IsHostPath(Path path) {
  return path == Path::kCma || path == Path::kDeviceToHost || path == Path::kCmaRead ||
         path == Path::kHostToOurDevice;
}

Status CudaIpcTransport::Execute(Batch& batch) {
  bool device_ops = false;
  for (const Op& op : batch.ops) {
    device_ops |= !IsHostPath(op.path);
  }
  if (Status s = RunHostOps(batch); !s.ok()) return s;
  return device_ops ? EnqueueDeviceOps(batch) : Status::OK();
}

Status CudaIpcTransport::RunHostOps(const Batch& batch) {
  uint64_t bounce_bytes = 0;
  size_t host_ops = 0;
  for (const Op& op : batch.ops) {
    if (op.path == Path::kDeviceToHost || op.path == Path::kHostToOurDevice) {
      bounce_bytes += op.bytes;
    }
    host_ops += IsHostPath(op.path);
  }
  if (host_ops == 0) return Status::OK();
  if (bounce_bytes > 0) bounce_.resize(bounce_bytes);
  std::vector<CmaWrite> writes;
  std::vector<CmaRead> reads;
  uint64_t bounce_at = 0;
  for (const Op& op : batch.ops) {
    if (op.path == Path::kCma) {
      writes.push_back({reinterpret_cast<const void*>(op.src), op.dst, op.bytes});
    } else if (op.path == Path::kCmaRead) {
      reads.push_back({op.src, reinterpret_cast<void*>(op.dst), op.bytes});
    } else if (op.path == Path::kHostToOurDevice) {
      // Read into our host memory first, copied to the GPU below.
      reads.push_back({op.src, bounce_.data() + bounce_at, op.bytes});
      bounce_at += op.bytes;
    } else if (op.path == Path::kDeviceToHost) {
      // Staged through our memory: process_vm_writev reads host memory only.
      uint8_t* staged = bounce_.data() + bounce_at;
      bounce_at += op.bytes;
      cudaError_t error = cudaMemcpyAsync(staged, reinterpret_cast<const void*>(op.src), op.bytes,
                                          cudaMemcpyDeviceToHost, stream_->get());
      if (error != cudaSuccess) return CudaError("cudaMemcpyAsync", error, "device to host");
      writes.push_back({staged, op.dst, op.bytes});
    }
  }
  if (!reads.empty()) {
    if (Status s = ReadProcessMemory(batch.target_pid, reads); !s.ok()) return s;
    bounce_at = 0;
    for (const Op& op : batch.ops) {
      if (op.path == Path::kDeviceToHost) bounce_at += op.bytes;
      if (op.path != Path::kHostToOurDevice) continue;
      cudaError_t error =
          cudaMemcpyAsync(reinterpret_cast<void*>(op.dst), bounce_.data() + bounce_at, op.bytes,
                          cudaMemcpyHostToDevice, stream_->get());
      bounce_at += op.bytes;
      if (error != cudaSuccess) {
        cudaStreamSynchronize(stream_->get());  // what was issued may still read the bounce
        return CudaError("cudaMemcpyAsync", error, "host to device");
      }
    }
  }
  // The bounce buffer is reused by the next batch: the copies through it finish first.
  if (bounce_bytes > 0) {
    if (cudaError_t error = cudaStreamSynchronize(stream_->get()); error != cudaSuccess) {
      return CudaError("cudaStreamSynchronize", error, "through the bounce buffer");
    }
  }
  return writes.empty() ? Status::OK() : WriteProcessMemory(batch.target_pid, writes);
}

Status CudaIpcTransport::EnqueueDeviceOps(Batch& batch) {
  cudaStream_t stream = stream_->get();
  bool enqueued = false;
  Status status;
  auto memcpy_async = [&](uint64_t dst, uint64_t src, uint64_t bytes, cudaMemcpyKind kind) {
    cudaError_t error = cudaMemcpyAsync(reinterpret_cast<void*>(dst),
                                        reinterpret_cast<const void*>(src), bytes, kind, stream);
    if (error != cudaSuccess) {
      status = CudaError("cudaMemcpyAsync", error,
                         "a copy of " + std::to_string(bytes) + " bytes between us and peer " +
                             std::to_string(batch.peer_id));
      return false;
    }
    enqueued = true;
    return true;
  };
  copies_.clear();
  for (const Op& op : batch.ops) {
    bool ok = true;
    switch (op.path) {
      case Path::kGather: copies_.push_back({op.src, op.dst, op.bytes}); break;
      case Path::kDeviceCopy: ok = memcpy_async(op.dst, op.src, op.bytes, cudaMemcpyDefault); break;
      case Path::kHostToDevice:
        ok = memcpy_async(op.dst, op.src, op.bytes, cudaMemcpyHostToDevice);
        break;
      case Path::kDeviceToOurHost:
        ok = memcpy_async(op.dst, op.src, op.bytes, cudaMemcpyDeviceToHost);
        break;
      case Path::kCma:
      case Path::kDeviceToHost:
      case Path::kCmaRead:
      case Path::kHostToOurDevice: break;  // done by RunHostOps
    }
    if (!ok) break;
  }
  if (status.ok() && !copies_.empty()) {
    CoalesceCopies(copies_, &descs_);
    if (copier_ != nullptr) {
      status = copier_->Enqueue(descs_, stream);
      enqueued |= status.ok();
    } else {
      for (const CopyDesc& d : descs_) {
        if (d.count == 1) {
          if (!memcpy_async(d.dst, d.src, d.bytes, cudaMemcpyDefault)) break;
        } else if (d.src_stride >= d.bytes && d.dst_stride >= d.bytes &&
                   d.src_stride <= kMaxPitch && d.dst_stride <= kMaxPitch) {
          cudaError_t error = cudaMemcpy2DAsync(reinterpret_cast<void*>(d.dst), d.dst_stride,
                                                reinterpret_cast<const void*>(d.src), d.src_stride,
                                                d.bytes, d.count, cudaMemcpyDefault, stream);
          if (error != cudaSuccess) {
            status = CudaError("cudaMemcpy2DAsync", error,
                               std::to_string(d.count) + " pieces of " + std::to_string(d.bytes) +
                                   " bytes to peer " + std::to_string(batch.peer_id));
            break;
          }
          enqueued = true;
        } else {
          bool ok = true;
          for (uint64_t i = 0; i < d.count && ok; ++i) {
            ok = memcpy_async(d.dst + i * d.dst_stride, d.src + i * d.src_stride, d.bytes,
                              cudaMemcpyDefault);
          }
          if (!ok) break;
        }
      }
    }
  }
  if (status.ok()) {
    auto event = TakeEvent();
    if (!event.ok()) {
      status = event.status();
    } else if (cudaError_t error = cudaEventRecord(*event, stream); error != cudaSuccess) {
      free_events_.push_back(*event);
      status = CudaError("cudaEventRecord", error);
    } else {
      batch.event = *event;
      return Status::OK();
    }
  }
  // Failed after part of the batch was issued: its callback must not run while that part may
  // still land, and there is no event to wait for.
  if (enqueued) cudaStreamSynchronize(stream);
  cudaGetLastError();
  return status;
}

StatusOr<cudaEvent_t> CudaIpcTransport::TakeEvent() {
  if (!free_events_.empty()) {
    cudaEvent_t event = free_events_.back();
    free_events_.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  if (cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      error != cudaSuccess) {
    return CudaError("cudaEventCreateWithFlags", error);
  }
  return event;
}

bool CudaIpcTransport::PollEvents() {
  bool completed = false;
  while (!gpu_pending_.empty()) {
    Batch& batch = *gpu_pending_.front();
    const cudaError_t error = cudaEventQuery(batch.event);
    if (error == cudaErrorNotReady) break;
    if (error != cudaSuccess) {
      // A failed kernel or copy leaves the context unusable: nothing more of it lands.
      batch.Fail(CudaError("cudaEventQuery", error,
                           "a write batch to peer " + std::to_string(batch.peer_id)));
      cudaGetLastError();
    }
    gpu_pending_.pop_front();
    FinishBatch(batch);
    completed = true;
  }
  return completed;
}

void CudaIpcTransport::FinishBatch(Batch& batch) {
  if (batch.event != nullptr) free_events_.push_back(std::exchange(batch.event, nullptr));
  PeerState& peer = *batch.peer;
  completions_.Add(peer.batches.Remove(batch));
  if (peer.disconnecting && peer.batches.empty()) ErasePeer(peer.id);
}

void CudaIpcTransport::DrainPeer(PeerState& peer) {
  const spi::PeerId id = peer.id;
  cudaEvent_t newest = nullptr;
  for (auto& batch : peer.batches) {
    batch->Fail(Status::Cancelled("cuda_ipc: peer " + std::to_string(id) + " disconnected"));
    if (batch->event != nullptr) newest = batch->event;
  }
  // Events on one stream complete in order: once the peer's newest has, all of its batches
  // (and every batch before them) are done and no write of theirs can land any more.
  if (newest != nullptr) cudaEventSynchronize(newest);
  PollEvents();
  auto it = peer_states_.find(id);
  if (it != peer_states_.end() && it->second->batches.empty()) ErasePeer(id);
}

void CudaIpcTransport::ErasePeer(spi::PeerId id) {
  auto it = peer_states_.find(id);
  if (it == peer_states_.end()) return;
  for (const IpcMappings::Handle& handle : it->second->mappings) mappings_.Release(handle);
  // Signalled after the callbacks: Disconnect returns once every one of them has run.
  for (auto& promise : it->second->on_erased) completions_.AddSignal(std::move(promise));
  peer_states_.erase(it);
}

void CudaIpcTransport::Shutdown() {
  // Every command queued before stopping has run. Wait for the stream, then cancel.
  for (auto& [id, peer] : peer_states_) {
    peer->disconnecting = true;
    for (auto& batch : peer->batches) {
      batch->Fail(Status::Cancelled("cuda_ipc: the transport is being destroyed"));
    }
  }
  if (!gpu_pending_.empty()) cudaEventSynchronize(gpu_pending_.back()->event);
  PollEvents();
  std::vector<spi::PeerId> left;
  for (const auto& [id, peer] : peer_states_) left.push_back(id);
  for (spi::PeerId id : left) ErasePeer(id);
  completions_.Run();
  // CUDA objects go on this thread, whose current device they were made on.
  for (cudaEvent_t event : free_events_) cudaEventDestroy(event);
  free_events_.clear();
  copier_.reset();
  digester_.reset();
  stream_.reset();
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
