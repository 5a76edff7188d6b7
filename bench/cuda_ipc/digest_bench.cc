// pdlib_digest_bench (issue #42): what the KV digest of GPU memory costs, next to what moving the
// same bytes costs on the same GPU.
//
//   memcpy D2D        one cudaMemcpyAsync of a request's bytes (contiguous): the baseline
//   digest pages      DeviceDigester over the request's pages, whole 32 KiB items (decode's pass)
//   digest slices     the same bytes as a TP 2 -> 1 sender digests them: each page's head
//                     slices (1 KiB: 4 heads of a token row, NHD) with the zeros after each
//   digest CPU        lib/base's CRC32C of the same bytes on one core of this host (a host pool)
//
// The shape is the transfer bench's: 32 layers x K,V x 32 KiB items, 16 scattered pages per
// request out of 128 per buffer (32 MiB a request). Each GPU case is checked once against the
// CPU's CRC32C of a host copy, then timed over 50 requests with a stream synchronisation each
// (DeviceDigester::Digest returns with the values). Prints a table and one JSON line. Without a
// usable GPU it says why and exits 0 (a skip).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda_ipc/digest_kernel.h"
#include "backends/cuda_ipc/digest_plan.h"
#include "lib/base/crc32c.h"

namespace pdlib::cuda_ipc {
namespace {

constexpr int kBuffers = 64;  // 32 layers x K,V
constexpr uint64_t kItem = 32768;
constexpr int kPoolPages = 128;
constexpr int kRequestPages = 16;
constexpr int kRequests = 50;
constexpr uint64_t kSlice = 1024;

#define BENCH_CUDA(call)                                                      \
  do {                                                                        \
    const cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int Main() {
  auto digester = DeviceDigester::Create(0);
  if (!digester.ok()) {
    std::printf("pdlib_digest_bench: SKIP: %s\n", digester.status().ToString().c_str());
    return 0;
  }
  const uint64_t pool = uint64_t{kBuffers} * kPoolPages * kItem;
  const uint64_t request = uint64_t{kBuffers} * kRequestPages * kItem;
  std::mt19937_64 rng(42);
  std::vector<uint8_t> host(pool);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  void* dev = nullptr;
  void* dst = nullptr;
  BENCH_CUDA(cudaMalloc(&dev, pool));
  BENCH_CUDA(cudaMalloc(&dst, request));
  BENCH_CUDA(cudaMemcpy(dev, host.data(), pool, cudaMemcpyHostToDevice));
  const auto base = reinterpret_cast<uint64_t>(dev);

  std::vector<int> pages(kPoolPages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  pages.resize(kRequestPages);
  std::vector<spi::DigestRange> whole, slices;
  for (int b = 0; b < kBuffers; ++b) {
    for (int p : pages) {
      const uint64_t at = (uint64_t{static_cast<uint64_t>(b)} * kPoolPages + p) * kItem;
      whole.push_back({base + at, kItem, 0});
      // Rank 0 of TP 2 -> 1: the first half of each 2 KiB token row.
      for (uint64_t row = 0; row < kItem; row += 2 * kSlice) {
        slices.push_back({base + at + row, kSlice, kItem - row - kSlice});
      }
    }
  }
  // Checked once against the CPU.
  for (auto* ranges : {&whole, &slices}) {
    std::vector<uint32_t> got(ranges->size());
    if (Status s = (*digester)->Digest(*ranges, got); !s.ok()) {
      std::fprintf(stderr, "digest failed: %s\n", s.ToString().c_str());
      return 1;
    }
    for (size_t i = 0; i < ranges->size(); ++i) {
      const spi::DigestRange& r = (*ranges)[i];
      const uint32_t want = Crc32cMulMod(Crc32cRaw(0, host.data() + (r.addr - base), r.length),
                                         Crc32cZerosFactor(r.zeros_after));
      if (got[i] != want) {
        std::fprintf(stderr, "pdlib_digest_bench: range %zu: GPU %08x, CPU %08x\n", i, got[i],
                     want);
        return 1;
      }
    }
  }
  std::vector<uint32_t> out(slices.size());
  auto time_digest = [&](const std::vector<spi::DigestRange>& ranges) {
    (void)(*digester)->Digest(ranges, out);  // warm
    const auto t0 = Clock::now();
    for (int i = 0; i < kRequests; ++i) (void)(*digester)->Digest(ranges, out);
    return Seconds(t0, Clock::now()) / kRequests;
  };
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CUDA(cudaMemcpyAsync(dst, dev, request, cudaMemcpyDeviceToDevice, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  auto t0 = Clock::now();
  for (int i = 0; i < kRequests; ++i) {
    BENCH_CUDA(cudaMemcpyAsync(dst, dev, request, cudaMemcpyDeviceToDevice, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  const double memcpy_s = Seconds(t0, Clock::now()) / kRequests;
  const double pages_s = time_digest(whole);
  const double slices_s = time_digest(slices);
  t0 = Clock::now();
  uint32_t sink = 0;
  for (const spi::DigestRange& r : whole)
    sink ^= Crc32cRaw(0, host.data() + (r.addr - base), r.length);
  const double cpu_s = Seconds(t0, Clock::now());
  const double gb = static_cast<double>(request) / 1e9;
  std::printf(
      "pdlib_digest_bench: %d buffers x %d pages x %llu KiB = %.1f MiB a request (%s CPU path)\n",
      kBuffers, kRequestPages, static_cast<unsigned long long>(kItem / 1024),
      static_cast<double>(request) / (1 << 20), Crc32cImplementation());
  std::printf("%-16s %10s %10s %8s\n", "case", "us/request", "GB/s", "x memcpy");
  const struct {
    const char* name;
    double s;
  } rows[] = {{"memcpy D2D", memcpy_s},
              {"digest pages", pages_s},
              {"digest slices", slices_s},
              {"digest CPU", cpu_s}};
  for (const auto& r : rows) {
    std::printf("%-16s %10.1f %10.1f %8.2f\n", r.name, r.s * 1e6, gb / r.s, r.s / memcpy_s);
  }
  std::printf(
      "{\"bench\":\"digest\",\"request_bytes\":%llu,\"memcpy_gbps\":%.2f,\"digest_pages_gbps\":%."
      "2f,"
      "\"digest_slices_gbps\":%.2f,\"digest_cpu_gbps\":%.2f,\"cpu_sink\":%u}\n",
      static_cast<unsigned long long>(request), gb / memcpy_s, gb / pages_s, gb / slices_s,
      gb / cpu_s, sink);
  (void)cudaStreamDestroy(stream);
  (void)cudaFree(dev);
  (void)cudaFree(dst);
  return 0;
}

}  // namespace
}  // namespace pdlib::cuda_ipc

int main() { return pdlib::cuda_ipc::Main(); }
