// The GPU digest kernel (digest_kernel.h): blocks walk the tiles of PlanDigestTiles, each thread
// takes one 64-byte segment of its block's tile (four 16-byte loads when the segment is aligned,
// bytes otherwise), the segments' terms are XORed across the block, and thread 0 shifts the
// tile's CRC past what follows it in its range and XORs it into the range's value. The
// arithmetic is digest_math.h's, the same functions DigestTilesOnCpu runs on the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backends/cuda_ipc/device_scope.h"
#include "backends/cuda_ipc/digest_kernel.h"
#include "backends/cuda_ipc/digest_math.h"
#include "backends/cuda_ipc/digest_plan.h"

namespace pdlib {
inline namespace v1 {
namespace cuda_ipc {
namespace {

__constant__ DigestTables g_tables;

std::string CudaText(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

__device__ __forceinline__ uint32_t SegmentCrc(const DigestTables& t, const uint8_t* p, uint32_t n,
                                               bool vector) {
  uint32_t crc = 0;
  if (vector) {
    uint4 v[kDigestSegmentBytes / 16];
#pragma unroll
    for (uint32_t k = 0; k < kDigestSegmentBytes / 16; ++k) {
      v[k] = reinterpret_cast<const uint4*>(p)[k];
    }
#pragma unroll
    for (uint32_t k = 0; k < kDigestSegmentBytes / 16; ++k) {
      crc = DigestWord(t, crc, v[k].x);
      crc = DigestWord(t, crc, v[k].y);
      crc = DigestWord(t, crc, v[k].z);
      crc = DigestWord(t, crc, v[k].w);
    }
    return crc;
  }
  for (uint32_t i = 0; i < n; ++i) crc = DigestByte(t, crc, p[i]);
  return crc;
}

__global__ void __launch_bounds__(kDigestThreads)
    DigestKernel(const DigestTile* tiles, uint64_t count, uint32_t* crcs) {
  __shared__ DigestTables t;
  __shared__ uint32_t warp_full[kDigestThreads / 32];
  __shared__ uint32_t warp_partial[kDigestThreads / 32];
  {
    const auto* from = reinterpret_cast<const uint32_t*>(&g_tables);
    auto* to = reinterpret_cast<uint32_t*>(&t);
    for (uint32_t i = threadIdx.x; i < sizeof(DigestTables) / 4; i += blockDim.x) to[i] = from[i];
  }
  __syncthreads();
  for (uint64_t at = blockIdx.x; at < count; at += gridDim.x) {
    const DigestTile tile = tiles[at];
    uint32_t begin = 0, end = 0;
    const bool full = DigestSegment(tile.length, threadIdx.x, &begin, &end);
    const auto* p = reinterpret_cast<const uint8_t*>(tile.addr) + begin;
    const bool vector = full && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
    const uint32_t crc = begin < end ? SegmentCrc(t, p, end - begin, vector) : 0;
    uint32_t full_term = full ? DigestFullSegmentTerm(t, crc, tile.length, threadIdx.x) : 0;
    uint32_t partial = !full ? crc : 0;
    for (int lane = 16; lane > 0; lane >>= 1) {
      full_term ^= __shfl_xor_sync(0xffffffffu, full_term, lane);
      partial ^= __shfl_xor_sync(0xffffffffu, partial, lane);
    }
    if ((threadIdx.x & 31) == 0) {
      warp_full[threadIdx.x / 32] = full_term;
      warp_partial[threadIdx.x / 32] = partial;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t fx = 0, px = 0;
      for (uint32_t w = 0; w < kDigestThreads / 32; ++w) {
        fx ^= warp_full[w];
        px ^= warp_partial[w];
      }
      const uint32_t tile_crc = DigestTileCrc(t, fx, px, tile.length);
      atomicXor(&crcs[tile.range], DigestMulMod(tile_crc, DigestZerosFactor(t, tile.after)));
    }
    __syncthreads();  // warp_* are rewritten by the next tile
  }
}

}  // namespace

DeviceDigester::~DeviceDigester() {
  DeviceScope scope(device_);
  auto stream = static_cast<cudaStream_t>(stream_);
  if (stream != nullptr) {
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  if (host_tiles_ != nullptr) (void)cudaFreeHost(host_tiles_);
  if (dev_tiles_ != nullptr) (void)cudaFree(dev_tiles_);
  if (host_crcs_ != nullptr) (void)cudaFreeHost(host_crcs_);
  if (dev_crcs_ != nullptr) (void)cudaFree(dev_crcs_);
}

StatusOr<std::unique_ptr<DeviceDigester>> DeviceDigester::Create(int device) {
  if (Status s = CheckCudaDevice(device); !s.ok()) return s;
  cudaError_t e = cudaSuccess;
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    return Status::Unavailable(CudaText("cudaSetDevice", scope.status()));
  }
  std::unique_ptr<DeviceDigester> d(new DeviceDigester());
  d->device_ = device;
  cudaStream_t stream = nullptr;
  e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return Status::Unavailable(CudaText("cudaStreamCreateWithFlags", e));
  d->stream_ = stream;
  cudaEvent_t event = nullptr;
  e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (e != cudaSuccess) return Status::Unavailable(CudaText("cudaEventCreateWithFlags", e));
  d->event_ = event;
  // The tables once per device (constant memory is per device and module).
  e = cudaMemcpyToSymbol(g_tables, &HostDigestTables(), sizeof(DigestTables));
  if (e != cudaSuccess) return Status::Unavailable(CudaText("uploading the digest tables", e));
  return StatusOr<std::unique_ptr<DeviceDigester>>(std::move(d));
}

Status DeviceDigester::Grow(size_t tiles, size_t ranges) {
  if (tiles > tile_capacity_) {
    const size_t want = std::max<size_t>({tiles, 2 * tile_capacity_, 256});
    if (host_tiles_ != nullptr) (void)cudaFreeHost(host_tiles_);
    if (dev_tiles_ != nullptr) (void)cudaFree(dev_tiles_);
    host_tiles_ = dev_tiles_ = nullptr;
    tile_capacity_ = 0;
    cudaError_t e = cudaMallocHost(&host_tiles_, want * sizeof(DigestTile));
    if (e == cudaSuccess) e = cudaMalloc(&dev_tiles_, want * sizeof(DigestTile));
    if (e != cudaSuccess) return Status::ResourceExhausted(CudaText("digest tile buffers", e));
    tile_capacity_ = want;
  }
  if (ranges > crc_capacity_) {
    const size_t want = std::max<size_t>({ranges, 2 * crc_capacity_, 256});
    if (host_crcs_ != nullptr) (void)cudaFreeHost(host_crcs_);
    if (dev_crcs_ != nullptr) (void)cudaFree(dev_crcs_);
    host_crcs_ = dev_crcs_ = nullptr;
    crc_capacity_ = 0;
    cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&host_crcs_), want * 4);
    if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&dev_crcs_), want * 4);
    if (e != cudaSuccess) return Status::ResourceExhausted(CudaText("digest result buffers", e));
    crc_capacity_ = want;
  }
  return Status::OK();
}

Status DeviceDigester::Digest(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs,
                              void* after) {
  if (crcs.size() < ranges.size()) {
    return Status::InvalidArgument("DeviceDigester: fewer CRCs than ranges");
  }
  for (size_t i = 0; i < ranges.size(); ++i) crcs[i] = 0;
  const std::vector<DigestTile> tiles = PlanDigestTiles(ranges);
  if (tiles.empty()) return Status::OK();
  DeviceScope scope(device_);
  if (scope.status() != cudaSuccess) {
    return Status::Unavailable(CudaText("cudaSetDevice", scope.status()));
  }
  if (Status s = Grow(tiles.size(), ranges.size()); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(stream_);
  cudaError_t e = cudaSuccess;
  if (after != nullptr) {
    e = cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(after));
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event_), 0);
    if (e != cudaSuccess) return Status::Internal(CudaText("ordering the digest", e));
  }
  std::memcpy(host_tiles_, tiles.data(), tiles.size() * sizeof(DigestTile));
  e = cudaMemcpyAsync(dev_tiles_, host_tiles_, tiles.size() * sizeof(DigestTile),
                      cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(dev_crcs_, 0, ranges.size() * 4, stream);
  if (e != cudaSuccess) return Status::Internal(CudaText("uploading digest tiles", e));
  int sms = 1;
  (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_);
  const auto grid = static_cast<unsigned>(std::min<uint64_t>(tiles.size(), uint64_t(sms) * 8));
  DigestKernel<<<grid, kDigestThreads, 0, stream>>>(static_cast<const DigestTile*>(dev_tiles_),
                                                    tiles.size(), dev_crcs_);
  e = cudaGetLastError();
  if (e != cudaSuccess) return Status::Internal(CudaText("launching the digest kernel", e));
  ++launches_;
  e = cudaMemcpyAsync(host_crcs_, dev_crcs_, ranges.size() * 4, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return Status::Internal(CudaText("the digest kernel", e));
  std::memcpy(crcs.data(), host_crcs_, ranges.size() * 4);
  return Status::OK();
}

}  // namespace cuda_ipc
}  // namespace v1
}  // namespace pdlib
