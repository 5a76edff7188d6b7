// pdlib_cuda_info: what kernels::ProbeCuda() sees on this machine, one "key: value" per line
// (scripts/gpu-check.sh's first step). Exit status 0 when a CUDA device can be used, 1 otherwise
// (with the reason).
#include <cstdio>

#include "pdlib_kernels/cuda_info.h"

int main() {
  const pdlib::kernels::CudaInfo info = pdlib::kernels::ProbeCuda();
  std::printf("compiled: %s\n", info.compiled ? "yes" : "no");
  std::printf("device_count: %d\n", info.device_count);
  if (info.device_count == 0) {
    std::printf("reason: %s\n", info.reason.c_str());
    return 1;
  }
  std::printf("device 0: %s\n", info.device_name.c_str());
  std::printf("compute_capability: %d.%d\n", info.compute_capability / 10,
              info.compute_capability % 10);
  std::printf("peak_dram_bandwidth: %.0f GB/s\n", info.peak_bandwidth_gbps);
  return 0;
}
