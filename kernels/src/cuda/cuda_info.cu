// ProbeCuda and the decode-attention bandwidth probe.
#include <string>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_kernels.cuh"
#include "pdlib_kernels/cuda_info.h"
#include "pdlib_kernels/kv_cache.h"

namespace pdlib::kernels {

CudaInfo ProbeCuda() {
  CudaInfo info;
  info.compiled = true;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")";
    return info;
  }
  if (count == 0) {
    info.reason = "cudaGetDeviceCount reports 0 devices";
    return info;
  }
  info.device_count = count;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    info.device_name = prop.name;
    info.compute_capability = prop.major * 10 + prop.minor;
  }
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0) == cudaSuccess) {
    // Double data rate: two transfers per clock.
    info.peak_bandwidth_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  }
  return info;
}

namespace {

// Owns a cudaEvent_t.
class CudaEvent {
 public:
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  cudaError_t Create() { return cudaEventCreate(&event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace

StatusOr<DecodeAttentionBandwidth> MeasureCudaDecodeAttention(const ModelConfig& config,
                                                              int32_t batch, int32_t context_len,
                                                              int32_t iterations) {
  using internal::DeviceBuffer;
  Status s = config.Validate();
  if (!s.ok()) return s;
  if (batch < 1 || context_len < 1 || iterations < 1) {
    return Status::InvalidArgument("batch, context_len and iterations must be positive");
  }
  if (config.head_dim > internal::kMaxAttentionHeadDim ||
      config.num_heads / config.num_kv_heads > internal::kMaxAttentionGroup) {
    return Status::Unimplemented("attention shape not supported by the CUDA kernel");
  }
  const CudaInfo info = ProbeCuda();
  if (info.device_count == 0) return Status::Unavailable(info.reason);
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));

  const int32_t pages_per_request = PagesForTokens(context_len, config.page_size);
  const size_t num_pages = static_cast<size_t>(batch) * pages_per_request;
  const size_t pool_bytes = num_pages * config.kv_page_bytes();
  DeviceBuffer k_pool, v_pool, q, out, positions, token_seq, pt_begin, page_tables, workspace;
  if (!(s = k_pool.Grow(pool_bytes)).ok() || !(s = v_pool.Grow(pool_bytes)).ok()) return s;
  // A bf16/fp32 pattern of small finite values; the bytes only have to be readable.
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemset(k_pool.get(), 0x3c, pool_bytes));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool.get(), 0x3c, pool_bytes));
  const size_t q_bytes = static_cast<size_t>(batch) * config.q_width() * sizeof(float);
  if (!(s = q.Grow(q_bytes)).ok() || !(s = out.Grow(q_bytes)).ok()) return s;
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemset(q.get(), 0x3c, q_bytes));

  std::vector<int32_t> pos(static_cast<size_t>(batch), context_len - 1), seq(batch), begin, pages;
  for (int32_t b = 0; b < batch; ++b) {
    seq[static_cast<size_t>(b)] = b;
    begin.push_back(b * pages_per_request);
    for (int32_t p = 0; p < pages_per_request; ++p) pages.push_back(b * pages_per_request + p);
  }
  begin.push_back(batch * pages_per_request);
  auto up = [](DeviceBuffer* buf, const std::vector<int32_t>& v) {
    return buf->Upload(v.data(), v.size() * sizeof(int32_t), nullptr);
  };
  if (!(s = up(&positions, pos)).ok() || !(s = up(&token_seq, seq)).ok() ||
      !(s = up(&pt_begin, begin)).ok() || !(s = up(&page_tables, pages)).ok()) {
    return s;
  }

  internal::PagedAttentionArgs a{};
  a.q = q.as<float>();
  a.q_stride = config.q_width();
  a.out = out.as<float>();
  a.out_stride = config.q_width();
  a.k_pool = k_pool.get();
  a.v_pool = v_pool.get();
  a.positions = positions.as<int32_t>();
  a.token_seq = token_seq.as<int32_t>();
  a.page_table_begin = pt_begin.as<int32_t>();
  a.page_tables = page_tables.as<int32_t>();
  a.num_tokens = batch;
  a.num_heads = config.num_heads;
  a.max_position = context_len - 1;
  a.shape = {config.page_size, config.num_kv_heads, config.head_dim,
             config.kv_layout == KVLayout::kHND, config.kv_dtype == KVDtype::kBFloat16};
  if (!(s = workspace.Grow(internal::PagedAttentionWorkspaceBytes(a))).ok()) return s;

  internal::CudaStream stream;
  if (!(s = stream.Create()).ok()) return s;
  CudaEvent start, stop;
  PDLIB_CUDA_RETURN_IF_ERROR(start.Create());
  PDLIB_CUDA_RETURN_IF_ERROR(stop.Create());
  for (int i = 0; i < 3; ++i) internal::LaunchPagedAttention(a, workspace.get(), stream.get());
  PDLIB_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream.get()));
  for (int i = 0; i < iterations; ++i) {
    internal::LaunchPagedAttention(a, workspace.get(), stream.get());
  }
  PDLIB_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream.get()));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  float ms = 0;
  PDLIB_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));

  DecodeAttentionBandwidth result;
  result.seconds_per_call = ms / 1e3 / iterations;
  result.bytes_per_call = 2.0 * batch * context_len * config.kv_width() * config.kv_elem_bytes() +
                          2.0 * static_cast<double>(q_bytes);
  result.achieved_gbps = result.bytes_per_call / result.seconds_per_call / 1e9;
  result.peak_gbps = info.peak_bandwidth_gbps;
  return result;
}

}  // namespace pdlib::kernels
