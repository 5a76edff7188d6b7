#include "bench/transfer/bench_args.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/common/flags.h"
#include "tools/netns/netns_plan.h"

ABSL_FLAG(std::string, backend, "fake", "transport backend: fake (moves no bytes), ucx, ...");
ABSL_FLAG(pdlib_tools::Repeated, backend_option, {},
          "a backend option K=V, repeatable (e.g. ucx.tls=shm, ucx.tls=tcp with "
          "ucx.net_devices=lo, ucx.max_inflight_bytes=8M)");
ABSL_FLAG(std::string, layers, "4", "model layers, a list; each has a K and a V buffer");
ABSL_FLAG(std::string, item_bytes, "4096", "bytes of one KV page of one buffer, a list");
ABSL_FLAG(std::string, pages, "4", "KV pages per request, a list");
ABSL_FLAG(std::string, layout, "scattered",
          "scattered|contiguous, a list. scattered: each request's pages are distinct pages at "
          "random in the pool, drawn independently on each side, so almost no write coalesces; "
          "contiguous: consecutive pages, one write per buffer per request");
ABSL_FLAG(std::string, pool_bytes, "1g",
          "KV pool of each side, all 2 x layers buffers together; k, m, g suffixes; pages per "
          "buffer = N / (2 x layers x item_bytes)");
ABSL_FLAG(uint64_t, pool_pages, 0, "pages per buffer instead of --pool_bytes (0: from it)");
ABSL_FLAG(uint64_t, prefill_tp, 1, "prefill TP ranks, as threads of the prefill process");
ABSL_FLAG(uint64_t, decode_tp, 1,
          "decode TP ranks, as threads of the decode process; with prefill_tp != decode_tp every "
          "page is sliced by heads (SPEC R5.4); item_bytes stays the page of the whole model, a "
          "rank holds 1/TP of it");
ABSL_FLAG(std::string, kv_layout, "hnd",
          "hnd|nhd: page layout [head][token][dim] or [token][head][dim]; an NHD head slice is "
          "page-size pieces per page");
ABSL_FLAG(uint64_t, kv_heads, 8, "KV heads of the model");
ABSL_FLAG(uint64_t, page_size, 16, "tokens per page");
ABSL_FLAG(std::string, pool_alloc, "backend",
          "backend|malloc. backend: pdlib::AllocateKVPool, which lets the backend allocate (UCX "
          "maps it for direct shared-memory puts; plain host memory for backends without an "
          "allocator); malloc: plain malloc");
ABSL_FLAG(std::string, memory, "host",
          "host|cuda: where both sides' KV pools live. cuda: cudaMalloc on --cuda_device "
          "(--pool_alloc then does not apply), registered with pdlib as kCuda, so the backend must "
          "reach GPU memory (cuda_ipc); --baseline memcpy then copies device to device with "
          "cudaMemcpyAsync. Exits 2 with the reason when no GPU can be used");
ABSL_FLAG(int32_t, cuda_device, 0, "with --memory cuda: the CUDA device of both sides' pools");
ABSL_FLAG(uint64_t, requests, 20000, "measured requests");
ABSL_FLAG(uint64_t, warmup, 500, "requests run before them, not measured");
ABSL_FLAG(std::string, concurrency, "256", "requests in flight at decode, a list");
ABSL_FLAG(uint64_t, transfer_workers, 2, "prefill's KVManagerOptions::transfer_workers");
ABSL_FLAG(uint32_t, room_log_every, 0,
          "both sides' KVManagerOptions::room_log_every (0: auto); the per-room info lines cost "
          "only with PDLIB_LOG_LEVEL=info");
ABSL_FLAG(bool, in_process, false,
          "both ranks as threads of this process (in-process control plane) instead of two "
          "processes over gRPC");
ABSL_FLAG(uint64_t, idle_spins, 64, "idle passes that yield before a driver sleeps");
ABSL_FLAG(uint64_t, idle_sleep_us, 20,
          "a driver's first sleep per idle pass afterwards; each further idle pass sleeps twice "
          "as long, up to --idle_sleep_max_us");
ABSL_FLAG(uint64_t, idle_sleep_max_us, 1000, "the longest idle sleep");
ABSL_FLAG(double, progress_every, 5,
          "decode prints its progress on stderr every S seconds (0: off)");
ABSL_FLAG(uint64_t, seed, 1, "pages and room ids derive from it");
ABSL_FLAG(bool, verify, false,
          "decode checks every byte of every request at its Success (a correctness run, not for "
          "figures; needs --concurrency 1)");
ABSL_FLAG(std::string, baseline, "none",
          "memcpy|none (run after the ranks have exited). memcpy: copies the same writes (the same "
          "pages, coalesced into the same runs, every K and V buffer) with memcpy in one thread "
          "between two pools allocated like the ranks', timed like them (with --memory cuda: "
          "cudaMemcpyAsync device to device on one stream, checked afterwards); adds baseline "
          "(memcpy or cudaMemcpy D2D), baseline_gbps (Gbit/s, the unit of gbps), "
          "baseline_gbytes_per_s and ratio = gbps / baseline_gbps");
ABSL_FLAG(bool, compare_perftest, false,
          "runs ucx_perftest -t ucp_put_bw between two processes on 127.0.0.1 at the most "
          "frequent write size, with UCX_TLS, UCX_NET_DEVICES and UCX_<NAME> from ucx.tls, "
          "ucx.net_devices and ucx.config.<NAME> (UCX's defaults otherwise), after the ranks have "
          "exited; adds perftest_gbytes_per_s (null, with a word on stderr, when ucx_perftest is "
          "not on PATH)");
ABSL_FLAG(bool, netns, false,
          "the prefill and the decode process each in a network namespace of its own (two hosts "
          "on a bridge, tools/netns; needs root), with ucx.tls=tcp and ucx.net_devices=eth0: "
          "what pdlib gets between two machines' network stacks");
ABSL_FLAG(bool, compare_iperf3, false,
          "after the ranks have exited, runs iperf3 (one TCP stream, 5 s) from where prefill ran "
          "to where decode ran (with --netns: between the two hosts, over the same veth link); "
          "adds iperf3_gbps and iperf3_ratio = gbps / iperf3_gbps (null, with a word on stderr, "
          "when iperf3 is not installed)");
ABSL_FLAG(std::string, rails, "1",
          "with --netns: the links (rails) between the two hosts that pdlib uses, a list (e.g. "
          "1,2: one configuration each, in one run, the later ones compared with the first). The "
          "hosts get that many veth links, each a bridge and a /24 of its own (tools/netns); UCX "
          "runs over eth0 for one rail, and pdlib stripes over eth0 ... eth<N-1> for N "
          "(ucx.rails: a worker and an endpoint per rail; see docs/backends.md \"Rails\")");
ABSL_FLAG(uint64_t, rail_mbit, 0,
          "with --netns: caps every rail of both hosts at this many Mbit/s each way (tc tbf; 0: "
          "no cap), so that rails, not the CPU, bound the transfer");
ABSL_FLAG(std::string, rail_fault, "",
          "with --netns and --rails: R,AT,FOR partitions rail R (0-based) of decode's host AT ms "
          "after the decode rank is ready (its warm-up included) and heals it FOR ms later, in "
          "every row with more than R rails; such a row samples decode's received bytes every "
          "100 ms and prints the throughput before, during and after the fault and how long after "
          "the heal it took to get back to 90% of before (JSON fault_*)");
ABSL_FLAG(double, stall_timeout, 30,
          "the parent gives up on a configuration when no request ended (succeeded or failed) for "
          "S seconds, naming the oldest request in flight and its state; a slow machine that "
          "still completes requests is never cut off");
ABSL_FLAG(bool, failures_ok, false,
          "failed requests do not fail a row (with --rail-fault: the requests a dead rail takes "
          "down); they are still counted (JSON failed, first_failure), and a wrong byte under "
          "--verify still fails the row (JSON wrong_bytes)");
ABSL_FLAG(std::string, prefill_nic_names, "",
          "KVArgs::nic_names of the prefill ranks, a comma list (e.g. rxa0,rxa1): the devices "
          "(rails) a backend uses where its own option does not name them (verbs.devices); "
          "with --decode_nic_names, rails whose two ends are different devices "
          "(test/rxe/rails.sh)");
ABSL_FLAG(std::string, decode_nic_names, "", "KVArgs::nic_names of the decode ranks");
ABSL_FLAG(std::string, prefill_host, "127.0.0.1",
          "internal: where a child's prefill rank listens and decode finds it");
ABSL_FLAG(uint64_t, layer_compute_us, 0,
          "simulate a prefill forward of this many microseconds per layer before each request's "
          "KV is sent (0: send at once); reports the exposed transfer time after the last layer");
ABSL_FLAG(std::string, layerwise, "off,on",
          "with --layer_compute_us: off (Send() after the last layer), on (SendLayers() after "
          "every layer), or a list; each is one configuration");
ABSL_FLAG(std::string, decode_prefix, "",
          "decode prefix reuse: R in [0, 1), or a list; decode already holds the first "
          "floor(R x pages) pages of each request and hands over only the rest with "
          "KVReceiver::Init(ReceiveRequest{pages after the prefix, decode_prefix_len, prompt_len "
          "= pages x page_size}); prefill reads decode_prefix_len() and PagesAfterPrefix() at "
          "WaitingForInput and sends only those pages. A fraction > 0 also runs 0 (the same "
          "calls, no prefix) first and compares the two; unset: the calls without a prefix "
          "(Init(pages, aux)), as before the prefix API");
ABSL_FLAG(std::string, checksum, "off",
          "off|sampled|all, or a comma list: KV integrity (KVManagerOptions::checksum, both "
          "sides; issue #42). Every configuration runs once per value; a row with a checksum "
          "prints its time per request against the same configuration's `off` row of this run "
          "(off is added first when the list lacks it)");
ABSL_FLAG(uint32_t, checksum_sample_every, 64,
          "with --checksum sampled: 1 room in this many is digested");
ABSL_FLAG(std::string, direction, "push",
          "push|pull|both: which way KV moves (KVManagerOptions::direction, both sides; issue "
          "#29). push: prefill writes into decode's pages once decode's TransferInfo is in; pull: "
          "prefill publishes each request's pages as soon as its sender exists and decode reads "
          "them (the backend must read); both: every configuration runs push, then pull, and "
          "each pull row is compared with its push row (pull_push_* fields)");
ABSL_FLAG(bool, json, false, "one JSON object per configuration instead of the table");
ABSL_FLAG(std::string, role, "", "internal: the role of a child process (prefill or decode)");
ABSL_FLAG(uint64_t, bootstrap_port, 8998, "internal: the bootstrap port of a child process");

namespace pdlib_bench {
namespace {

constexpr char kUsage[] =
    "usage: pdlib-transfer-bench [flags]\n"
    "\n"
    "Drives KV transfers through pdlib between a prefill and a decode process and reports, per\n"
    "configuration, one table row (or one JSON object per line with --json). List flags\n"
    "(--layers, --item_bytes, --pages, --layout, --concurrency) take comma-separated values and\n"
    "every combination runs.\n"
    "\n"
    "Figures (measured at decode): seconds from the first measured CreateReceiver() to the last\n"
    "Success; req_per_s = requests / seconds; p50_us, p99_us, ...: CreateReceiver() to Success\n"
    "per request; decode_cpu_s: CPU seconds of the decode process (all threads) over `seconds`\n"
    "(near zero for the data path when puts land directly, as with UCX shm into a UCX pool);\n"
    "gbps: KV payload (pages x 2 x layers x item_bytes per request) in Gbit/s\n"
    "(10^9 bits), gbytes_per_s: the same in GB/s (10^9 bytes). The fake backend moves no bytes:\n"
    "its figures are the rate at which write batches were validated and completed.\n"
    "\n"
    "Layer-wise streaming: --layer_compute_us N makes prefill compute each request before sending\n"
    "it, one request at a time (one GPU), N us per layer (it sleeps: a GPU leaves the CPU free);\n"
    "with --layerwise on it announces each finished layer (KVSender::SendLayers), with off it\n"
    "calls Send() after the last one. exposed_*_us: from the end of the last layer to decode's\n"
    "Success, per request (prefill stamps the end in the metadata slot; both processes read one\n"
    "monotonic clock). The transfer time that streaming hides is the difference of the two.\n"
    "  e.g. pdlib-transfer-bench --backend ucx --backend-option ucx.tls=tcp --backend-option\n"
    "       ucx.net_devices=lo --layers 32 --item-bytes 32768 --pages 64 --concurrency 1\n"
    "       --requests 20 --warmup 3 --layer-compute-us 2000\n"
    "\n"
    "Decode prefix reuse: --decode-prefix R makes decode hold the first floor(R x pages) pages of\n"
    "every request already (its prefix cache) and hand over only the rest; prefill learns the\n"
    "prefix at WaitingForInput (decode_prefix_len(), PagesAfterPrefix()) and sends only the pages\n"
    "after it. kv_bytes_per_request: the KV payload that moves (pages_sent x 2 x layers x\n"
    "item_bytes; gbps counts only it); moved_bytes_per_request: what prefill's managers counted\n"
    "(KVManagerMetrics::bytes_transferred, every TP rank, over warm-up and measured requests);\n"
    "us_per_request: seconds / succeeded requests. R > 0 runs R = 0 first, the same shape\n"
    "without a prefix, and reports both with bytes_ratio and time_ratio (R over 0). --verify\n"
    "then checks every page after the prefix, and that every prefix page (zeroed before Init)\n"
    "was not written.\n"
    "  e.g. pdlib-transfer-bench --backend ucx --backend-option ucx.tls=shm --layers 32\n"
    "       --item-bytes 32768 --pages 16 --concurrency 1 --requests 200 --warmup 20\n"
    "       --decode-prefix 0.9\n"
    "\n"
    "Decode pull: --direction pull makes decode read prefill's published pages (one-sided\n"
    "reads) instead of prefill writing them; --direction both runs every configuration push,\n"
    "then pull, and reports pull over push from the same run: pull_push_gbps_ratio,\n"
    "pull_push_mean_us_ratio (and the push figures). moved_bytes_per_request and\n"
    "batches_per_request then count what decode read and its read batches.\n"
    "  e.g. pdlib-transfer-bench --backend ucx --backend-option ucx.tls=shm --layers 32\n"
    "       --item-bytes 32768 --pages 16 --concurrency 4 --requests 400 --warmup 20\n"
    "       --direction both\n"
    "\n"
    "Rails: --netns --rails 1,2 --rail-mbit M gives the two hosts two links (one per rail), each\n"
    "capped at M Mbit/s, and runs every configuration over one rail, then over both (pdlib\n"
    "striping over eth0,eth1: ucx.rails); each later row is compared with the first\n"
    "(rails_gbps_ratio).\n"
    "  e.g. pdlib-transfer-bench --netns --rails 1,2 --rail-mbit 2000 --backend ucx --layers 32\n"
    "       --item-bytes 32768 --pages 16 --concurrency 4 --requests 200 --warmup 20\n"
    "\n"
    "GPU memory: --memory cuda puts both pools on the GPU (cudaMalloc) and --baseline memcpy\n"
    "then times the same writes as device-to-device cudaMemcpyAsync, in the same run:\n"
    "  e.g. pdlib-transfer-bench --memory cuda --backend cuda_ipc --layers 32 --item-bytes 32768\n"
    "       --pages 16 --layout scattered --concurrency 4 --requests 2000 --warmup 100\n"
    "       --baseline memcpy\n";

bool ParseU64(std::string_view text, uint64_t* out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

// "1g", "512m", "64k", "4096" -> bytes.
bool ParseBytes(std::string_view text, uint64_t* out) {
  uint64_t shift = 0;
  if (!text.empty()) {
    switch (text.back()) {
      case 'k':
      case 'K': shift = 10; break;
      case 'm':
      case 'M': shift = 20; break;
      case 'g':
      case 'G': shift = 30; break;
      default: break;
    }
  }
  if (shift != 0) text.remove_suffix(1);
  if (!ParseU64(text, out) || *out == 0 || *out > (~uint64_t{0} >> shift)) return false;
  *out <<= shift;
  return true;
}

bool ParseList(std::string_view text, std::vector<uint64_t>* out) {
  out->clear();
  while (!text.empty()) {
    const size_t comma = text.find(',');
    uint64_t v = 0;
    if (!ParseU64(text.substr(0, comma), &v) || v == 0) return false;
    out->push_back(v);
    text = comma == std::string_view::npos ? "" : text.substr(comma + 1);
  }
  return !out->empty();
}

}  // namespace

std::string_view LayoutName(Layout l) {
  return l == Layout::kScattered ? "scattered" : "contiguous";
}

bool ParseArgs(int argc, char** argv, Options* o) {
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage, {}, {"backend_option"});
  // Each check names its flag and the value it refused.
  auto bad = [](const char* flag, const std::string& value) {
    std::fprintf(stderr, "pdlib-transfer-bench: bad value '%s' for --%s (see --help)\n",
                 value.c_str(), flag);
    return false;
  };
  BenchConfig& b = o->base;
  o->json = absl::GetFlag(FLAGS_json);
  o->in_process = absl::GetFlag(FLAGS_in_process);
  o->compare_perftest = absl::GetFlag(FLAGS_compare_perftest);
  o->failures_ok = absl::GetFlag(FLAGS_failures_ok);
  o->stall_timeout_s = absl::GetFlag(FLAGS_stall_timeout);
  if (!(o->stall_timeout_s > 0)) return bad("stall_timeout", std::to_string(o->stall_timeout_s));
  b.verify = absl::GetFlag(FLAGS_verify);
  b.backend = absl::GetFlag(FLAGS_backend);
  for (const std::string& kv : absl::GetFlag(FLAGS_backend_option).values) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) return bad("backend_option", kv);
    b.backend_options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  b.requests = absl::GetFlag(FLAGS_requests);
  if (b.requests == 0) return bad("requests", "0");
  b.warmup = absl::GetFlag(FLAGS_warmup);
  const std::pair<const char*, std::vector<uint64_t>*> lists[] = {{"concurrency", &o->concurrency},
                                                                  {"pages", &o->pages},
                                                                  {"layers", &o->layers},
                                                                  {"item_bytes", &o->item_bytes}};
  const std::string list_values[] = {absl::GetFlag(FLAGS_concurrency), absl::GetFlag(FLAGS_pages),
                                     absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_item_bytes)};
  for (size_t i = 0; i < 4; ++i) {
    if (!ParseList(list_values[i], lists[i].second)) return bad(lists[i].first, list_values[i]);
  }
  const uint64_t prefill_tp = absl::GetFlag(FLAGS_prefill_tp),
                 decode_tp = absl::GetFlag(FLAGS_decode_tp);
  if (prefill_tp < 1 || prefill_tp > 64) return bad("prefill_tp", std::to_string(prefill_tp));
  if (decode_tp < 1 || decode_tp > 64) return bad("decode_tp", std::to_string(decode_tp));
  b.prefill_tp = int32_t(prefill_tp);
  b.decode_tp = int32_t(decode_tp);
  const std::string kv_layout = absl::GetFlag(FLAGS_kv_layout);
  if (kv_layout != "hnd" && kv_layout != "nhd") return bad("kv_layout", kv_layout);
  b.kv_layout = kv_layout == "nhd" ? pdlib::KVLayout::kNHD : pdlib::KVLayout::kHND;
  const uint64_t kv_heads = absl::GetFlag(FLAGS_kv_heads),
                 page_size = absl::GetFlag(FLAGS_page_size);
  if (kv_heads < 1 || kv_heads > 1024) return bad("kv_heads", std::to_string(kv_heads));
  if (page_size < 1 || page_size > 4096) return bad("page_size", std::to_string(page_size));
  b.kv_heads = int32_t(kv_heads);
  b.page_size = uint32_t(page_size);
  b.pool_pages = absl::GetFlag(FLAGS_pool_pages);
  const std::string pool_bytes = absl::GetFlag(FLAGS_pool_bytes);
  if (!ParseBytes(pool_bytes, &b.pool_bytes)) return bad("pool_bytes", pool_bytes);
  const std::string pool_alloc = absl::GetFlag(FLAGS_pool_alloc);
  if (pool_alloc != "backend" && pool_alloc != "malloc") return bad("pool_alloc", pool_alloc);
  b.pool_alloc = pool_alloc == "malloc" ? PoolAlloc::kMalloc : PoolAlloc::kBackend;
  const std::string memory = absl::GetFlag(FLAGS_memory);
  if (memory != "host" && memory != "cuda") return bad("memory", memory);
  b.memory = memory == "cuda" ? pdlib::MemoryKind::kCuda : pdlib::MemoryKind::kHost;
  b.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  if (b.cuda_device < 0 || b.cuda_device > 1023) {
    return bad("cuda_device", std::to_string(b.cuda_device));
  }
  const std::string baseline = absl::GetFlag(FLAGS_baseline);
  if (baseline != "memcpy" && baseline != "none") return bad("baseline", baseline);
  o->baseline_memcpy = baseline == "memcpy";
  b.progress_every_s = absl::GetFlag(FLAGS_progress_every);
  if (!(b.progress_every_s >= 0)) return bad("progress_every", std::to_string(b.progress_every_s));
  o->layouts.clear();
  const std::string layouts = absl::GetFlag(FLAGS_layout);
  for (absl::string_view name : absl::StrSplit(layouts, ',')) {
    if (name != "scattered" && name != "contiguous") return bad("layout", layouts);
    o->layouts.push_back(name == "scattered" ? Layout::kScattered : Layout::kContiguous);
  }
  const uint64_t workers = absl::GetFlag(FLAGS_transfer_workers);
  if (workers < 1 || workers > 64) return bad("transfer_workers", std::to_string(workers));
  b.transfer_workers = int32_t(workers);
  b.room_log_every = absl::GetFlag(FLAGS_room_log_every);
  b.idle_spins = absl::GetFlag(FLAGS_idle_spins);
  b.idle_sleep_us = absl::GetFlag(FLAGS_idle_sleep_us);
  b.idle_sleep_max_us = absl::GetFlag(FLAGS_idle_sleep_max_us);
  b.seed = absl::GetFlag(FLAGS_seed);
  b.layer_compute_us = absl::GetFlag(FLAGS_layer_compute_us);
  if (b.layer_compute_us > 10'000'000) {
    return bad("layer_compute_us", std::to_string(b.layer_compute_us));
  }
  o->layerwise.clear();
  const std::string layerwise = absl::GetFlag(FLAGS_layerwise);
  for (absl::string_view v : absl::StrSplit(layerwise, ',')) {
    if (v != "on" && v != "off") return bad("layerwise", layerwise);
    o->layerwise.push_back(v == "on");
  }
  if (b.layer_compute_us == 0) o->layerwise = {false};
  const std::string decode_prefix = absl::GetFlag(FLAGS_decode_prefix);
  if (!decode_prefix.empty()) {
    o->decode_prefixes.clear();
    bool has_zero = false, has_more = false;
    for (absl::string_view v : absl::StrSplit(decode_prefix, ',')) {
      double r = 0;
      if (!absl::SimpleAtod(v, &r) || !(r >= 0 && r < 1)) {
        return bad("decode_prefix", decode_prefix);
      }
      if (std::find(o->decode_prefixes.begin(), o->decode_prefixes.end(), r) !=
          o->decode_prefixes.end()) {
        continue;
      }
      (r == 0 ? has_zero : has_more) = true;
      o->decode_prefixes.push_back(r);
    }
    // (A child process runs the one configuration it is given.)
    const bool child = !absl::GetFlag(FLAGS_role).empty();
    if (has_more && !has_zero && !child) {
      o->decode_prefixes.insert(o->decode_prefixes.begin(), 0.0);
    }
    // The comparison row first: each fraction's row then carries its ratios.
    std::stable_partition(o->decode_prefixes.begin(), o->decode_prefixes.end(),
                          [](const std::optional<double>& r) { return *r == 0; });
  }
  const std::string direction = absl::GetFlag(FLAGS_direction);
  if (direction == "push") {
    o->directions = {pdlib::TransferDirection::kPush};
  } else if (direction == "pull") {
    o->directions = {pdlib::TransferDirection::kPull};
  } else if (direction == "both") {
    o->directions = {pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull};
  } else {
    return bad("direction", direction);
  }
  {
    o->checksums.clear();
    for (absl::string_view v : absl::StrSplit(absl::GetFlag(FLAGS_checksum), ',')) {
      if (v == "off") {
        o->checksums.push_back(pdlib::KvChecksum::kOff);
      } else if (v == "sampled") {
        o->checksums.push_back(pdlib::KvChecksum::kSampled);
      } else if (v == "all") {
        o->checksums.push_back(pdlib::KvChecksum::kAll);
      } else {
        return bad("checksum", std::string(v));
      }
    }
    const bool child = !absl::GetFlag(FLAGS_role).empty();
    if (!child && o->checksums.size() > 1 && o->checksums.front() != pdlib::KvChecksum::kOff) {
      std::erase(o->checksums, pdlib::KvChecksum::kOff);
      o->checksums.insert(o->checksums.begin(), pdlib::KvChecksum::kOff);
    }
    o->base.checksum = o->checksums.front();
    o->base.checksum_sample_every = absl::GetFlag(FLAGS_checksum_sample_every);
    if (o->base.checksum_sample_every == 0) return bad("checksum_sample_every", "0");
  }
  o->role = absl::GetFlag(FLAGS_role);
  if (!o->role.empty() && o->role != "prefill" && o->role != "decode") return bad("role", o->role);
  const uint64_t bootstrap_port = absl::GetFlag(FLAGS_bootstrap_port);
  if (bootstrap_port == 0 || bootstrap_port > 65535) {
    return bad("bootstrap_port", std::to_string(bootstrap_port));
  }
  b.bootstrap_port = uint16_t(bootstrap_port);
  b.prefill_host = absl::GetFlag(FLAGS_prefill_host);
  for (auto [flag, out] : {std::pair{absl::GetFlag(FLAGS_prefill_nic_names), &b.prefill_nic_names},
                           std::pair{absl::GetFlag(FLAGS_decode_nic_names), &b.decode_nic_names}}) {
    for (size_t at = 0; !flag.empty() && at <= flag.size();) {
      const size_t comma = std::min(flag.find(',', at), flag.size());
      if (comma == at) return bad("prefill_nic_names/decode_nic_names", flag);
      out->push_back(flag.substr(at, comma - at));
      at = comma + 1;
    }
  }
  if (b.prefill_host.empty()) return bad("prefill_host", "");
  o->netns = absl::GetFlag(FLAGS_netns);
  o->compare_iperf3 = absl::GetFlag(FLAGS_compare_iperf3);
  if (o->netns && o->in_process) return bad("netns", "with --in-process");
  const std::string rails = absl::GetFlag(FLAGS_rails);
  std::vector<uint64_t> rail_counts;
  if (!ParseList(rails, &rail_counts)) return bad("rails", rails);
  o->rails.clear();
  for (uint64_t n : rail_counts) {
    if (n > uint64_t(pdlib_tools::kMaxRails)) return bad("rails", rails);
    if (n > 1 && !o->netns) return bad("rails", rails + " without --netns");
    o->rails.push_back(int(n));
  }
  if (const std::string fault = absl::GetFlag(FLAGS_rail_fault); !fault.empty()) {
    std::vector<uint64_t> f;
    if (!ParseList(fault, &f) || f.size() != 3 || f[0] >= uint64_t(pdlib_tools::kMaxRails) ||
        f[1] > 3600000 || f[2] == 0 || f[2] > 3600000) {
      return bad("rail_fault", fault + " (R,AT_MS,FOR_MS)");
    }
    if (!o->netns) return bad("rail_fault", fault + " without --netns");
    o->rail_fault = {int(f[0]), int(f[1]), int(f[2])};
  }
  const uint64_t rail_mbit = absl::GetFlag(FLAGS_rail_mbit);
  if (rail_mbit > 1000000) return bad("rail_mbit", std::to_string(rail_mbit));
  if (rail_mbit > 0 && !o->netns) {
    return bad("rail_mbit", std::to_string(rail_mbit) + " without --netns");
  }
  o->rail_mbit = int(rail_mbit);
  return true;
}

std::vector<std::string> ChildArgs(const BenchConfig& c, std::string_view role) {
  std::vector<std::string> a = {"--role",
                                std::string(role),
                                "--backend",
                                c.backend,
                                "--requests",
                                std::to_string(c.requests),
                                "--warmup",
                                std::to_string(c.warmup),
                                "--concurrency",
                                std::to_string(c.concurrency),
                                "--layers",
                                std::to_string(c.layers),
                                "--item-bytes",
                                std::to_string(c.item_bytes),
                                "--pages",
                                std::to_string(c.pages),
                                "--pool-pages",
                                std::to_string(c.PoolPages()),
                                "--pool-alloc",
                                c.pool_alloc == PoolAlloc::kMalloc ? "malloc" : "backend",
                                "--progress-every",
                                std::to_string(c.progress_every_s),
                                "--layout",
                                std::string(LayoutName(c.layout)),
                                "--transfer-workers",
                                std::to_string(c.transfer_workers),
                                "--room-log-every",
                                std::to_string(c.room_log_every),
                                "--idle-spins",
                                std::to_string(c.idle_spins),
                                "--idle-sleep-us",
                                std::to_string(c.idle_sleep_us),
                                "--idle-sleep-max-us",
                                std::to_string(c.idle_sleep_max_us),
                                "--seed",
                                std::to_string(c.seed),
                                "--prefill-tp",
                                std::to_string(c.prefill_tp),
                                "--decode-tp",
                                std::to_string(c.decode_tp),
                                "--kv-layout",
                                c.kv_layout == pdlib::KVLayout::kNHD ? "nhd" : "hnd",
                                "--kv-heads",
                                std::to_string(c.kv_heads),
                                "--page-size",
                                std::to_string(c.page_size),
                                "--bootstrap-port",
                                std::to_string(c.bootstrap_port),
                                "--prefill-host",
                                c.prefill_host,
                                "--layer-compute-us",
                                std::to_string(c.layer_compute_us),
                                "--layerwise",
                                c.layerwise ? "on" : "off",
                                "--memory",
                                c.memory == pdlib::MemoryKind::kCuda ? "cuda" : "host",
                                "--cuda-device",
                                std::to_string(c.cuda_device),
                                "--direction",
                                std::string(pdlib::TransferDirectionName(c.direction)),
                                "--checksum",
                                c.checksum == pdlib::KvChecksum::kAll       ? "all"
                                : c.checksum == pdlib::KvChecksum::kSampled ? "sampled"
                                                                            : "off",
                                "--checksum-sample-every",
                                std::to_string(c.checksum_sample_every)};
  if (c.verify) a.push_back("--verify");
  for (auto [flag, names] : {std::pair{"--prefill-nic-names", &c.prefill_nic_names},
                             std::pair{"--decode-nic-names", &c.decode_nic_names}}) {
    std::string joined;
    for (const std::string& n : *names) joined += (joined.empty() ? "" : ",") + n;
    if (!joined.empty()) {
      a.push_back(flag);
      a.push_back(joined);
    }
  }
  if (c.decode_prefix) {
    char r[32];
    std::snprintf(r, sizeof(r), "%.17g", *c.decode_prefix);  // exact: the same pages held
    a.push_back("--decode-prefix");
    a.push_back(r);
  }
  for (const auto& [k, v] : c.backend_options) {
    a.push_back("--backend-option");
    a.push_back(k + "=" + v);
  }
  return a;
}

}  // namespace pdlib_bench
