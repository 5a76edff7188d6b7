// The one-pass gather kernel. Blocks walk the flat tile space of a TilePlan (copy_plan.h,
// tile_map.h): each tile is one chunk of a large piece or a group of whole small pieces, at most
// kTileUnits vectors, so every block moves about the same bytes whatever the piece size (a
// 256-byte NHD head row and a 32 KiB HND item alike) and all 256 threads stay busy. Each thread
// issues kUnroll independent loads before its stores to keep enough bytes in flight. The vector
// is the widest of 16/8/4/2/1 bytes that divides the descriptor's addresses, length and strides.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "backends/cuda_ipc/device_scope.h"
#include "backends/cuda_ipc/gather_copy.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

constexpr uint32_t kThreads = GatherCopier::kThreads;
constexpr uint32_t kUnroll = GatherCopier::kUnroll;
constexpr uint32_t kTileUnits = GatherCopier::kTileUnits;

std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

template <typename T>
__device__ __forceinline__ void CopyTile(const TiledDesc& d, const TileSpan& s) {
  T values[kUnroll] = {};
  uint64_t dst[kUnroll] = {};
#pragma unroll
  for (uint32_t k = 0; k < kUnroll; ++k) {
    const uint32_t v = threadIdx.x + k * kThreads;
    if (v < s.total) {
      uint64_t src = 0;
      UnitAddress(d, s, v, &src, &dst[k]);
      values[k] = *reinterpret_cast<const T*>(src);
    }
  }
#pragma unroll
  for (uint32_t k = 0; k < kUnroll; ++k) {
    if (threadIdx.x + k * kThreads < s.total) *reinterpret_cast<T*>(dst[k]) = values[k];
  }
}

__global__ void __launch_bounds__(kThreads)
    GatherKernel(const TiledDesc* descs, const uint64_t* tile_start, uint32_t n, uint64_t tiles) {
  for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint32_t i = FindTileDesc(tile_start, n, tile);
    const TiledDesc d = descs[i];
    const TileSpan s = TileOf(d, tile - tile_start[i], kTileUnits);
    switch (d.unit_shift) {
      case 4: CopyTile<uint4>(d, s); break;
      case 3: CopyTile<uint2>(d, s); break;
      case 2: CopyTile<uint32_t>(d, s); break;
      case 1: CopyTile<uint16_t>(d, s); break;
      default: CopyTile<uint8_t>(d, s); break;
    }
  }
}

// One descriptor upload: pinned staging, its device copy, and the event behind the last kernel
// that read it.
struct Slot {
  void* host = nullptr;
  void* device = nullptr;
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
};

}  // namespace

struct GatherCopier::Rep {
  int max_blocks = 1;  // resident blocks of the kernel on the whole device
  int next = 0;        // the slot the next Enqueue takes
  Slot slots[kRingSlots];
  TilePlan plan;  // scratch, reused
};

GatherCopier::GatherCopier(int device, std::unique_ptr<Rep> rep)
    : device_(device), rep_(std::move(rep)) {}

GatherCopier::~GatherCopier() {
  DeviceScope scope(device_);
  for (Slot& slot : rep_->slots) {
    // Nothing is freed under a kernel that may still read it.
    if (slot.done != nullptr) {
      (void)cudaEventSynchronize(slot.done);
      (void)cudaEventDestroy(slot.done);
    }
    if (slot.host != nullptr) (void)cudaFreeHost(slot.host);
    if (slot.device != nullptr) (void)cudaFree(slot.device);
  }
}

StatusOr<std::unique_ptr<GatherCopier>> GatherCopier::Create(int device) {
  if (Status s = CheckCudaDevice(device); !s.ok()) return s;
  cudaError_t e = cudaSuccess;
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    return Status::Unavailable(
        CudaError(("cudaSetDevice(" + std::to_string(device) + ")").c_str(), scope.status()));
  }
  auto rep = std::make_unique<Rep>();
  int sms = 0;
  int per_sm = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GatherKernel, kThreads, 0);
  }
  if (e != cudaSuccess) return Status::Unavailable(CudaError("GatherCopier device query", e));
  rep->max_blocks = std::max(1, sms * std::max(1, per_sm));
  std::unique_ptr<GatherCopier> copier(new GatherCopier(device, std::move(rep)));
  for (Slot& slot : copier->rep_->slots) {
    e = cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      slot.done = nullptr;
      return Status::Unavailable(CudaError("cudaEventCreateWithFlags", e));
    }
  }
  return StatusOr<std::unique_ptr<GatherCopier>>(std::move(copier));
}

Status GatherCopier::Enqueue(std::span<const CopyDesc> descs, void* stream) {
  if (descs.empty()) return Status::OK();
  TilePlan& plan = rep_->plan;
  if (Status s = PlanTiles(descs, kTileUnits, &plan); !s.ok()) return s;
  DeviceScope scope(device_);
  if (scope.status() != cudaSuccess) {
    return Status::Unavailable(CudaError("cudaSetDevice", scope.status()));
  }
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  Slot& slot = rep_->slots[rep_->next];
  rep_->next = (rep_->next + 1) % kRingSlots;

  // The slot's previous kernel (and the upload before it) must be done before its staging or
  // device buffer is rewritten or freed.
  cudaError_t e = cudaEventSynchronize(slot.done);
  if (e != cudaSuccess) return Status::Internal(CudaError("waiting for a descriptor slot", e));
  const size_t desc_bytes = plan.descs.size() * sizeof(TiledDesc);
  const size_t bytes = desc_bytes + plan.tile_start.size() * sizeof(uint64_t);
  if (bytes > slot.capacity) {
    const size_t want = std::max<size_t>({bytes, 2 * slot.capacity, 4096});
    if (slot.host != nullptr) (void)cudaFreeHost(slot.host);
    if (slot.device != nullptr) (void)cudaFree(slot.device);
    slot.host = nullptr;
    slot.device = nullptr;
    slot.capacity = 0;
    e = cudaMallocHost(&slot.host, want);
    if (e == cudaSuccess) e = cudaMalloc(&slot.device, want);
    if (e != cudaSuccess) {
      if (slot.host != nullptr) (void)cudaFreeHost(slot.host);
      slot.host = nullptr;
      return Status::ResourceExhausted(
          CudaError(("descriptor buffers of " + std::to_string(want) + " bytes").c_str(), e));
    }
    slot.capacity = want;
  }
  auto* host = static_cast<unsigned char*>(slot.host);
  std::memcpy(host, plan.descs.data(), desc_bytes);
  std::memcpy(host + desc_bytes, plan.tile_start.data(), bytes - desc_bytes);
  e = cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, cuda_stream);
  if (e != cudaSuccess) return Status::Internal(CudaError("uploading copy descriptors", e));

  const uint64_t tiles = plan.tiles();
  const auto grid = static_cast<unsigned>(std::min<uint64_t>(tiles, rep_->max_blocks));
  const auto* device_descs = static_cast<const TiledDesc*>(slot.device);
  const auto* tile_start = reinterpret_cast<const uint64_t*>(
      static_cast<const unsigned char*>(slot.device) + desc_bytes);
  GatherKernel<<<grid, kThreads, 0, cuda_stream>>>(device_descs, tile_start,
                                                   static_cast<uint32_t>(plan.descs.size()), tiles);
  e = cudaGetLastError();
  // Recorded even after a failed launch, so that the slot's wait covers the upload.
  const cudaError_t recorded = cudaEventRecord(slot.done, cuda_stream);
  if (e != cudaSuccess) return Status::Internal(CudaError("launching the gather kernel", e));
  if (recorded != cudaSuccess) return Status::Internal(CudaError("cudaEventRecord", recorded));
  return Status::OK();
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
