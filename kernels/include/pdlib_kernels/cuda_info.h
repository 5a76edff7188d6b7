// What the CUDA side of pdlib_kernels can do on this machine, and a probe of the decode
// attention kernel's memory bandwidth. Standard C++ only: no CUDA type appears here, and every
// function exists (and reports why it cannot help) in builds without CUDA.
#ifndef PDLIB_KERNELS_CUDA_INFO_H_
#define PDLIB_KERNELS_CUDA_INFO_H_

#include <cstdint>
#include <string>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"

namespace pdlib::kernels {

struct CudaInfo {
  bool compiled = false;           // the library was built with the CUDA kernels
  int32_t device_count = 0;        // usable CUDA devices (0 when none or when not compiled)
  std::string reason;              // why no device can be used; empty when device_count > 0
  std::string device_name;         // device 0
  int32_t compute_capability = 0;  // device 0, e.g. 90 for sm_90
  double peak_bandwidth_gbps = 0;  // device 0's theoretical DRAM bandwidth, GB/s
};

// Safe to call from any thread, any number of times, with or without a GPU.
CudaInfo ProbeCuda();

struct DecodeAttentionBandwidth {
  double seconds_per_call = 0;  // mean over the timed launches
  double bytes_per_call = 0;    // K and V bytes the kernel must read, plus q and output
  double achieved_gbps = 0;     // bytes_per_call / seconds_per_call
  double peak_gbps = 0;         // ProbeCuda().peak_bandwidth_gbps
};

// Times the paged decode-attention kernel alone: `batch` requests of `context_len` tokens each,
// with `config`'s heads, head_dim, page size, layout and dtype, on CUDA device 0.
// kUnavailable without a GPU.
StatusOr<DecodeAttentionBandwidth> MeasureCudaDecodeAttention(const ModelConfig& config,
                                                              int32_t batch, int32_t context_len,
                                                              int32_t iterations);

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_CUDA_INFO_H_
