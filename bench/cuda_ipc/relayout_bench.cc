// pdlib_relayout_bench (issue #19): what the one-pass gather kernel gives a KV transfer on one
// GPU, next to what the copy engines give the same bytes.
//
//   memcpy            one cudaMemcpyAsync D2D of a request's bytes (contiguous): the baseline
//   memcpy runs       the 1:1 request as one cudaMemcpyAsync per planned write
//   gather 1:1        the 1:1 request through GatherCopier (one kernel)
//   gather TP P->1    prefill TP P -> decode TP 1, NHD and HND: every prefill rank's head
//                     slices, coalesced, in one kernel (the M:N re-layout)
//
// The shape is the transfer bench's: 32 layers x K,V x 32 KiB items (8 KV heads x 128 dims x
// bf16 x 16 tokens), 16 scattered pages per request out of 128 per buffer; the writes are the
// real planner's (MakePairPlan + PlanKvWrites), resolved onto cudaMalloc'ed pools. Each case
// is checked once against per-write cudaMemcpyAsync (every destination byte compared), then
// timed over 100 requests (8 page sets in turn) with events on one stream. Prints a table and
// one JSON line; the target is re-layout >= 0.70 of the 1:1 gather. Without a usable
// GPU it says why and exits 0 (a skip).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda_ipc/copy_plan.h"
#include "backends/cuda_ipc/gather_copy.h"
#include "lib/planner/kv_layout_testing.h"
#include "lib/planner/planner.h"

namespace pdlib::cuda_ipc {
namespace {

namespace planner = pdlib::planner;

constexpr int32_t kLayers = 32;
constexpr int32_t kHeads = 8;
constexpr uint32_t kPageSize = 16;
constexpr uint64_t kHeadBytes = 256;  // 128 dims x bf16
constexpr int32_t kPoolPages = 128;
constexpr size_t kRequestPages = 16;
constexpr int kPageSets = 8;
constexpr int kWarmup = 10;
constexpr int kRequests = 100;

#define BENCH_CUDA(call)                                                      \
  do {                                                                        \
    const cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

planner::SideLayout Layout(int32_t tp_size, int32_t tp_rank, KVLayout layout) {
  return planner::KvOnlySideLayout({kLayers, kHeads, kPageSize, kHeadBytes, kPoolPages}, tp_size,
                                   tp_rank, layout);
}

// One side's pool: a cudaMalloc'ed block per buffer.
struct Pool {
  std::vector<void*> buffers;
  uint64_t buffer_bytes = 0;
  Pool(int32_t count, uint64_t bytes) : buffer_bytes(bytes) {
    for (int32_t i = 0; i < count; ++i) {
      void* p = nullptr;
      BENCH_CUDA(cudaMalloc(&p, bytes));
      BENCH_CUDA(cudaMemset(p, i + 1, bytes));
      buffers.push_back(p);
    }
    BENCH_CUDA(cudaDeviceSynchronize());  // the kernels run on a non-blocking stream
  }
  ~Pool() {
    for (void* p : buffers) (void)cudaFree(p);
  }
  uint64_t Addr(uint32_t b) const { return reinterpret_cast<uint64_t>(buffers[b]); }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> out(buffers.size() * buffer_bytes);
    for (size_t b = 0; b < buffers.size(); ++b) {
      BENCH_CUDA(cudaMemcpy(out.data() + b * buffer_bytes, buffers[b], buffer_bytes,
                            cudaMemcpyDeviceToHost));
    }
    return out;
  }
  void Clear() const {
    for (void* p : buffers) BENCH_CUDA(cudaMemset(p, 0, buffer_bytes));
    BENCH_CUDA(cudaDeviceSynchronize());
  }
};

std::vector<int32_t> RandomPages(std::mt19937_64& rng) {
  std::vector<int32_t> pool(kPoolPages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(kRequestPages);
  return pool;
}

// One case: each request's copies (uncoalesced, for the check) and descriptors.
struct Case {
  std::string name;
  int32_t prefill_tp = 1;
  KVLayout layout = KVLayout::kNHD;
  std::vector<std::vector<ResolvedCopy>> copies = {};  // per page set
  std::vector<std::vector<CopyDesc>> descs = {};       // per page set
  double gbps = 0;
};

// Plans prefill TP `tp` -> decode TP 1 for every page set and resolves onto the pools.
void PlanCase(Case* c, const std::vector<std::unique_ptr<Pool>>& src, const Pool& dst,
              const std::vector<std::vector<int32_t>>& src_pages,
              const std::vector<std::vector<int32_t>>& dst_pages) {
  const planner::SideLayout decode = Layout(1, 0, c->layout);
  for (int s = 0; s < kPageSets; ++s) {
    std::vector<ResolvedCopy> copies;
    std::vector<CopyDesc> descs;
    for (int32_t r = 0; r < c->prefill_tp; ++r) {
      StatusOr<planner::PairPlan> plan =
          planner::MakePairPlan(Layout(c->prefill_tp, r, c->layout), decode);
      if (!plan.ok()) {
        std::fprintf(stderr, "MakePairPlan: %s\n", plan.status().ToString().c_str());
        std::exit(1);
      }
      planner::PlanOutput out;
      planner::ChunkPages chunk;
      chunk.src_pages = src_pages[static_cast<size_t>(s)];
      chunk.dst_pages = dst_pages[static_cast<size_t>(s)];
      chunk.is_last = true;
      if (Status st = planner::PlanKvWrites(*plan, chunk, &out); !st.ok()) {
        std::fprintf(stderr, "PlanKvWrites: %s\n", st.ToString().c_str());
        std::exit(1);
      }
      std::vector<ResolvedCopy> rank;
      for (const planner::PlannedWrite& w : out.writes) {
        rank.push_back({src[static_cast<size_t>(r)]->Addr(w.local_buffer) + w.local_offset,
                        dst.Addr(w.remote_buffer) + w.remote_offset, w.length});
      }
      // Each prefill rank coalesces its own batch, as its transport would.
      std::vector<CopyDesc> rank_descs;
      CoalesceCopies(rank, &rank_descs);
      descs.insert(descs.end(), rank_descs.begin(), rank_descs.end());
      copies.insert(copies.end(), rank.begin(), rank.end());
    }
    c->copies.push_back(std::move(copies));
    c->descs.push_back(std::move(descs));
  }
}

template <typename Fn>
double TimeRequests(cudaStream_t stream, uint64_t bytes, Fn&& request) {
  for (int i = 0; i < kWarmup; ++i) request(i % kPageSets);
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  BENCH_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < kRequests; ++i) request(i % kPageSets);
  BENCH_CUDA(cudaEventRecord(stop, stream));
  BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  return static_cast<double>(bytes) * kRequests / (static_cast<double>(ms) * 1e-3) / 1e9;
}

int Main() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: pdlib_relayout_bench needs a GPU: %s\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
    return 0;
  }
  BENCH_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  StatusOr<std::unique_ptr<GatherCopier>> made = GatherCopier::Create(0);
  if (!made.ok()) {
    std::printf("SKIP: %s\n", made.status().ToString().c_str());
    return 0;
  }
  GatherCopier& copier = **made;
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::mt19937_64 rng(19);
  std::vector<std::vector<int32_t>> src_pages, dst_pages;
  for (int s = 0; s < kPageSets; ++s) {
    src_pages.push_back(RandomPages(rng));
    dst_pages.push_back(RandomPages(rng));
  }
  const uint64_t dst_item = kPageSize * kHeads * kHeadBytes;
  const uint64_t request_bytes = 2ull * kLayers * kRequestPages * dst_item;
  Pool decode(2 * kLayers, dst_item * kPoolPages);
  Pool reference(2 * kLayers, dst_item * kPoolPages);

  std::vector<Case> cases = {{"gather 1:1", 1, KVLayout::kNHD},
                             {"gather TP 2->1 NHD", 2, KVLayout::kNHD},
                             {"gather TP 2->1 HND", 2, KVLayout::kHND},
                             {"gather TP 8->1 NHD", 8, KVLayout::kNHD},
                             {"gather TP 8->1 HND", 8, KVLayout::kHND}};
  // The contiguous baseline's own blocks: a request's bytes in one piece.
  void* flat_src = nullptr;
  void* flat_dst = nullptr;
  BENCH_CUDA(cudaMalloc(&flat_src, request_bytes));
  BENCH_CUDA(cudaMalloc(&flat_dst, request_bytes));
  BENCH_CUDA(cudaMemset(flat_src, 7, request_bytes));
  BENCH_CUDA(cudaDeviceSynchronize());
  double memcpy_runs = 0;
  double memcpy_flat = 0;
  for (Case& c : cases) {
    std::vector<std::unique_ptr<Pool>> prefill;
    for (int32_t r = 0; r < c.prefill_tp; ++r) {
      prefill.push_back(std::make_unique<Pool>(2 * kLayers, dst_item / c.prefill_tp * kPoolPages));
    }
    PlanCase(&c, prefill, decode, src_pages, dst_pages);
    // Check: page set 0 through the kernel vs one cudaMemcpyAsync per planned write.
    decode.Clear();
    reference.Clear();
    if (Status s = copier.Enqueue(c.descs[0], stream); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), s.ToString().c_str());
      return 1;
    }
    for (const ResolvedCopy& w : c.copies[0]) {
      // The same write into the reference pool's buffer (the pools are separate allocations).
      for (uint32_t b = 0; b < decode.buffers.size(); ++b) {
        if (w.dst >= decode.Addr(b) && w.dst < decode.Addr(b) + decode.buffer_bytes) {
          BENCH_CUDA(cudaMemcpyAsync(
              reinterpret_cast<void*>(reference.Addr(b) + (w.dst - decode.Addr(b))),
              reinterpret_cast<const void*>(w.src), w.bytes, cudaMemcpyDeviceToDevice, stream));
          break;
        }
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (decode.Read() != reference.Read()) {
      std::fprintf(stderr, "%s: the kernel's bytes differ from cudaMemcpy's\n", c.name.c_str());
      return 1;
    }
    uint64_t writes = 0, descs = 0;
    for (int s = 0; s < kPageSets; ++s) {
      writes += c.copies[static_cast<size_t>(s)].size();
      descs += c.descs[static_cast<size_t>(s)].size();
    }
    c.gbps = TimeRequests(stream, request_bytes, [&](int s) {
      if (Status st = copier.Enqueue(c.descs[static_cast<size_t>(s)], stream); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", c.name.c_str(), st.ToString().c_str());
        std::exit(1);
      }
    });
    std::printf("%-22s %8.1f GB/s  (%llu writes -> %llu descriptors per request)\n", c.name.c_str(),
                c.gbps, static_cast<unsigned long long>(writes / kPageSets),
                static_cast<unsigned long long>(descs / kPageSets));
    if (c.prefill_tp == 1) {
      // The copy engines on the same writes, then on the same bytes in one piece.
      memcpy_runs = TimeRequests(stream, request_bytes, [&](int s) {
        for (const ResolvedCopy& w : c.copies[static_cast<size_t>(s)]) {
          BENCH_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(w.dst),
                                     reinterpret_cast<const void*>(w.src), w.bytes,
                                     cudaMemcpyDeviceToDevice, stream));
        }
      });
      memcpy_flat = TimeRequests(stream, request_bytes, [&](int) {
        BENCH_CUDA(
            cudaMemcpyAsync(flat_dst, flat_src, request_bytes, cudaMemcpyDeviceToDevice, stream));
      });
      std::printf("%-22s %8.1f GB/s\n%-22s %8.1f GB/s\n", "memcpy runs", memcpy_runs, "memcpy",
                  memcpy_flat);
    }
  }
  const double one = cases[0].gbps;
  std::printf("\n%-22s %10s %12s %12s\n", "case", "GB/s", "vs memcpy", "vs 1:1");
  std::printf("%-22s %10.1f %12.2f %12s\n", "memcpy", memcpy_flat, 1.0, "");
  std::printf("%-22s %10.1f %12.2f %12s\n", "memcpy runs", memcpy_runs, memcpy_runs / memcpy_flat,
              "");
  for (const Case& c : cases) {
    std::printf("%-22s %10.1f %12.2f %12.2f\n", c.name.c_str(), c.gbps, c.gbps / memcpy_flat,
                c.gbps / one);
  }
  const double nhd = cases[1].gbps / one;
  const double hnd = cases[2].gbps / one;
  std::printf(
      "{\"bench\":\"relayout\",\"device\":\"%s\",\"request_bytes\":%llu,\"memcpy_gbps\":%.1f,"
      "\"memcpy_runs_gbps\":%.1f,\"gather_1to1_gbps\":%.1f,\"tp2_nhd_gbps\":%.1f,"
      "\"tp2_hnd_gbps\":%.1f,\"tp8_nhd_gbps\":%.1f,\"tp8_hnd_gbps\":%.1f,"
      "\"gather_1to1_vs_memcpy\":%.3f,\"tp2_nhd_vs_1to1\":%.3f,\"tp2_hnd_vs_1to1\":%.3f,"
      "\"tp8_nhd_vs_1to1\":%.3f,\"tp8_hnd_vs_1to1\":%.3f,\"target\":0.70,\"meets_target\":%s}\n",
      prop.name, static_cast<unsigned long long>(request_bytes), memcpy_flat, memcpy_runs, one,
      cases[1].gbps, cases[2].gbps, cases[3].gbps, cases[4].gbps, one / memcpy_flat, nhd, hnd,
      cases[3].gbps / one, cases[4].gbps / one, nhd >= 0.70 && hnd >= 0.70 ? "true" : "false");
  BENCH_CUDA(cudaStreamDestroy(stream));
  BENCH_CUDA(cudaFree(flat_src));
  BENCH_CUDA(cudaFree(flat_dst));
  return 0;
}

}  // namespace
}  // namespace pdlib::cuda_ipc

int main() { return pdlib::cuda_ipc::Main(); }
