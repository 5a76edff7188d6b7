// Random copy batches for the cuda_ipc copy tests: offsets into a source and a destination
// buffer whose destinations never overlap (the gather kernel writes in no particular order),
// built from the shapes the planner produces (contiguous runs, constant-stride runs, singles)
// with random lengths and alignments. Shared by copy_plan_test (CPU) and gather_copy_test (GPU).
#ifndef PDLIB_TEST_CUDA_IPC_COPY_BATCHES_H_
#define PDLIB_TEST_CUDA_IPC_COPY_BATCHES_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda_ipc/copy_plan.h"

namespace pdlib::cuda_ipc::testing {

// Copies as offsets (src and dst fields) into buffers of src_size and dst_size bytes.
inline std::vector<ResolvedCopy> RandomBatch(std::mt19937_64& rng, uint64_t src_size,
                                             uint64_t dst_size, bool aligned, int patterns) {
  std::vector<uint8_t> used(dst_size, 0);
  std::vector<ResolvedCopy> out;
  auto pick = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  const uint64_t lengths[] = {1, 3, 16, 48, 256, 512, 4096, 32768};
  for (int p = 0; p < patterns; ++p) {
    uint64_t bytes = pick(0, 3) == 0 ? pick(0, 600) : lengths[pick(0, 7)];
    if (aligned) bytes = (bytes + 15) / 16 * 16;
    if (bytes > dst_size / 8) bytes = dst_size / 8;
    const uint64_t count = pick(0, 2) == 0 ? 1 : pick(2, 24);
    const uint64_t src_stride = bytes + (pick(0, 1) ? 0 : pick(0, 3) * (aligned ? 16 : pick(1, 9)));
    const uint64_t dst_stride = bytes + (pick(0, 1) ? 0 : pick(0, 3) * (aligned ? 16 : pick(1, 9)));
    if (bytes == 0 || (count - 1) * src_stride + bytes > src_size ||
        (count - 1) * dst_stride + bytes > dst_size) {
      continue;
    }
    uint64_t src = pick(0, src_size - ((count - 1) * src_stride + bytes));
    uint64_t dst = pick(0, dst_size - ((count - 1) * dst_stride + bytes));
    if (aligned) {
      src &= ~uint64_t{15};
      dst &= ~uint64_t{15};
    }
    bool free = true;
    for (uint64_t i = 0; i < count && free; ++i) {
      for (uint64_t b = 0; b < bytes && free; ++b) free = used[dst + i * dst_stride + b] == 0;
    }
    if (!free) continue;
    for (uint64_t i = 0; i < count; ++i) {
      for (uint64_t b = 0; b < bytes; ++b) used[dst + i * dst_stride + b] = 1;
      out.push_back({src + i * src_stride, dst + i * dst_stride, bytes});
    }
  }
  return out;
}

inline std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// "" when equal, else where the first difference is (a whole-buffer CHECK would print
// megabytes).
inline std::string Diff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return "first difference at byte " + std::to_string(i) + " of " + std::to_string(got.size()) +
             ": got " + std::to_string(got[i]) + ", want " + std::to_string(want[i]);
    }
  }
  return "";
}

// The batch with the offsets moved onto base addresses.
inline std::vector<ResolvedCopy> Rebase(const std::vector<ResolvedCopy>& copies, uint64_t src,
                                        uint64_t dst) {
  std::vector<ResolvedCopy> out = copies;
  for (ResolvedCopy& c : out) {
    c.src += src;
    c.dst += dst;
  }
  return out;
}

}  // namespace pdlib::cuda_ipc::testing

#endif  // PDLIB_TEST_CUDA_IPC_COPY_BATCHES_H_
