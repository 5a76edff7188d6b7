// The two sides of pdlib-transfer-bench: a prefill rank and a decode rank that drive a stream of
// requests through pdlib's public API as an engine would, as fast as the library lets them.
//
// Both ranks derive every request from the configuration alone (room id = base + index, pages
// from a seeded generator), so they need no coordination beyond what pdlib itself does: prefill
// creates its senders ahead of time, up to the concurrency window, and sends as soon as each
// one's TransferInfo has arrived; decode keeps `concurrency` receivers in flight and measures
// each request from CreateReceiver() to Success.
//
// Threads: each Run*Rank call drives its rank from the calling thread only.
#ifndef PDLIB_BENCH_TRANSFER_BENCH_RANKS_H_
#define PDLIB_BENCH_TRANSFER_BENCH_RANKS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "pdlib/pdlib.h"

namespace pdlib_bench {

enum class Layout { kScattered, kContiguous };
// How the KV pools are allocated: pdlib::AllocateKVPool(backend) or plain malloc.
enum class PoolAlloc { kBackend, kMalloc };

struct BenchConfig {
  std::string backend = "fake";
  std::map<std::string, std::string> backend_options;
  uint64_t requests = 20000;  // measured requests
  uint64_t warmup = 500;      // requests run (and not measured) before them
  uint64_t concurrency = 256;
  uint64_t layers = 4;  // model layers; each has a K and a V buffer
  uint64_t item_bytes = 4096;
  uint64_t pages = 4;                       // KV pages per request
  uint64_t pool_bytes = uint64_t{1} << 30;  // per side, every K and V buffer together
  uint64_t pool_pages = 0;                  // pages per buffer; 0: as many as pool_bytes holds
  PoolAlloc pool_alloc = PoolAlloc::kBackend;
  // Where both sides' KV pools live: host memory (allocated as pool_alloc says), or GPU memory
  // on CUDA device cuda_device (cudaMalloc), registered with pdlib as kCuda.
  pdlib::MemoryKind memory = pdlib::MemoryKind::kHost;
  int32_t cuda_device = 0;
  Layout layout = Layout::kScattered;
  uint64_t seed = 1;
  uint16_t bootstrap_port = 8998;
  // Where prefill's control endpoint and bootstrap server listen, and where decode finds them
  // (--netns: the prefill host's address).
  std::string prefill_host = "127.0.0.1";
  // KVArgs::nic_names of each side's ranks (the devices a backend uses when its own option does
  // not name them, e.g. verbs.devices): rails whose ends differ per host.
  std::vector<std::string> prefill_nic_names;
  std::vector<std::string> decode_nic_names;
  int32_t transfer_workers = 2;
  uint32_t room_log_every = 0;  // KVManagerOptions::room_log_every, both sides
  // Idle passes over the handles that yield the CPU before the driver starts sleeping.
  uint64_t idle_spins = 64;
  uint64_t idle_sleep_us = 20;        // first sleep; each further idle pass sleeps twice as long
  uint64_t idle_sleep_max_us = 1000;  // up to this
  pdlib::ControlPlane control_plane = pdlib::ControlPlane::kGrpc;
  // Decode compares every page of every request, at its Success, with what prefill's pool held
  // (needs concurrency 1: requests in flight together may write the same page).
  bool verify = false;
  // Tensor parallelism (issue #5): each side runs this many ranks as threads of its process,
  // each holding kv_heads / tp of the model's heads; item_bytes is a page of the WHOLE model
  // (TP 1), so a rank's page is item_bytes / tp and the bytes per request do not change with TP.
  int32_t prefill_tp = 1;
  int32_t decode_tp = 1;
  pdlib::KVLayout kv_layout = pdlib::KVLayout::kHND;
  int32_t kv_heads = 8;     // KV heads of the model
  uint32_t page_size = 16;  // tokens per page
  int32_t tp_rank = 0;      // set per rank thread
  // Decode prints a progress line on stderr every this many seconds once a run is past it
  // (0: never).
  double progress_every_s = 5;
  // Simulated prefill forward (issue #17): each request is computed, one at a time, for this
  // many microseconds per layer before its KV is complete (0: none, send at once). With
  // `layerwise` each finished layer is announced with SendLayers(); else Send() follows the
  // last layer.
  uint64_t layer_compute_us = 0;
  bool layerwise = false;
  // Decode prefix reuse (issue #27, SPEC R11.1): the fraction of each request's pages that decode
  // already holds, in [0, 1), rounded down to whole pages (PrefixPages). The prompt is `pages`
  // whole pages (PromptTokens). nullopt: the ranks call the API as before the prefix existed
  // (KVReceiver::Init(pages, aux), KVSender::Init(pages)). A value, 0 included: decode calls
  // Init(ReceiveRequest) with the pages after the prefix, decode_prefix_len and prompt_len;
  // prefill, at WaitingForInput, reads decode_prefix_len() and PagesAfterPrefix(prompt_len),
  // Init()s with that count and sends the pages after the prefix, as an engine would (prefill
  // never reads this field: it learns the prefix from decode).
  std::optional<double> decode_prefix;
  // Which way KV moves (issue #29; KVManagerOptions::direction, both sides). kPull: prefill
  // Init()s and Send()s each request as soon as its sender exists (the pages are published; it
  // does not wait for decode's TransferInfo), every page of the prompt whatever decode's prefix
  // (PagesAfterPrefix counts them all); decode reads them. The rank that moves the bytes counts
  // them (RankResult::metrics): prefill in push, decode in pull.
  pdlib::TransferDirection direction = pdlib::TransferDirection::kPush;
  // --checksum (issue #42; KVManagerOptions::checksum, both sides): off, sampled (1 room in
  // checksum_sample_every) or all.
  pdlib::KvChecksum checksum = pdlib::KvChecksum::kOff;
  uint32_t checksum_sample_every = 64;
  // --netns --rails (issue #31): the links between the two hosts this configuration uses (UCX
  // over eth0 ... eth<rails-1>) and the cap on each (0: none). Reported only; the backend
  // options carry them to the ranks.
  int rails = 1;
  int rail_mbit = 0;
  // The bytes decode's host received on each rail of the cluster (eth0, eth1, ...) while the
  // row ran, warm-up included: whether the transfer was striped. Empty when unknown.
  std::vector<uint64_t> rail_rx_bytes;
  // --rail-fault: what decode received before, during and after a rail's partition (set by the
  // parent for the rows it faulted; reported only).
  struct FaultFigures {
    int rail = 0, at_ms = 0, for_ms = 0;     // as asked
    double fault_at_ms = 0, heal_at_ms = 0;  // as done, ms after decode was ready
    double before_gbps = 0, during_gbps = 0, after_gbps = 0;
    double recovery_ms = -1;  // heal -> first 100 ms back at >= 90% of before; -1: not in the run
    std::vector<std::pair<double, double>> timeline;  // (ms, Gbit/s of the 100 ms ending there)
    std::string error;
  };
  std::optional<FaultFigures> fault;

  // Pages per K or V buffer: pool_pages, else what pool_bytes holds; never fewer than `pages`.
  uint64_t PoolPages() const;
  // Pages of each request that decode holds already (floor(decode_prefix x pages); 0 without a
  // prefix) and the pages that move.
  uint64_t PrefixPages() const;
  uint64_t SentPages() const { return pages - PrefixPages(); }
  uint64_t PromptTokens() const { return pages * page_size; }
  // KV payload that moves per request (the pages after the prefix, every K and V buffer).
  uint64_t BytesPerRequest() const { return SentPages() * 2 * layers * item_bytes; }
  uint64_t FirstRoom() const;  // room of request 0 (warm-up included)
  // Name of what carries the bytes: a backend's transport choice (e.g. ucx.tls) or its name.
  std::string Transport() const;
};

struct RankResult {
  std::string error;  // empty when the rank ran to the end
  uint64_t succeeded = 0;
  uint64_t failed = 0;
  uint64_t wrong = 0;  // of `failed`: requests whose bytes --verify found wrong
  std::string first_failure;
  double seconds = 0;      // decode: first measured request to last completion
  double cpu_seconds = 0;  // decode: CPU time of the whole process (all threads) over `seconds`
  std::vector<uint32_t> latencies_us;  // decode: CreateReceiver() to Success, measured requests
  // decode, with layer_compute_us: the end of prefill's last layer to Success, measured requests
  std::vector<uint32_t> exposed_us;
  // Of the rank's manager, at the end (with TP, rank 0's; bytes_transferred: every rank's of
  // the side together).
  pdlib::KVManagerMetrics metrics;
  std::string pool_allocator;  // who allocated the KV pool (BenchPool::allocator())
};

// Runs the prefill rank: creates its manager (serving the bootstrap server when
// `start_bootstrap`), calls `on_ready(endpoint)`, serves warm-up + measured requests, then calls
// `before_teardown(result)` (which returns when the manager may go) and destroys everything.
RankResult RunPrefillRank(const BenchConfig& config, bool start_bootstrap,
                          const std::function<void(const std::string&)>& on_ready,
                          const std::function<void(const RankResult&)>& before_teardown);

// Runs the decode rank: creates its manager, waits until prefill accepts connections (at most
// 30 s), calls `on_ready()`, runs the warm-up requests, then the measured ones.
RankResult RunDecodeRank(const BenchConfig& config, const std::function<void()>& on_ready);

// The same for every TP rank of a side (config.prefill_tp / decode_tp threads, one manager each;
// prefill rank 0 serves the bootstrap server). on_ready runs once every rank is ready and
// before_teardown once with the combined result; latencies and counts are merged, seconds is the
// slowest rank's.
RankResult RunPrefillRanks(const BenchConfig& config, bool start_bootstrap,
                           const std::function<void(const std::string&)>& on_ready,
                           const std::function<void(const RankResult&)>& before_teardown);
RankResult RunDecodeRanks(const BenchConfig& config, const std::function<void()>& on_ready);

// How far this process's decode drivers have come, for the parent's stall clock
// (--stall_timeout): the requests that ended (succeeded or failed, warm-up included, every TP
// rank together) and the oldest request in flight with its state and age ("request 12 (room
// 1099511627788) in Transferring for 3.2 s"; empty when none is). Safe from any thread.
struct DecodeProgress {
  uint64_t ended = 0;
  std::string oldest;
};
DecodeProgress CurrentDecodeProgress();

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_BENCH_RANKS_H_
