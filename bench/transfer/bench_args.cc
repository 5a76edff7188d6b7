#include "bench/transfer/bench_args.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace pdlib_bench {
namespace {

constexpr char kUsage[] =
    "usage: pdlib-transfer-bench [options]\n"
    "\n"
    "Drives KV transfers through pdlib between a prefill and a decode process and reports, per\n"
    "configuration, one table row (or one JSON object per line with --json).\n"
    "\n"
    "What moves:\n"
    "  --backend NAME            transport backend: fake (moves no bytes), ucx, ... (fake)\n"
    "  --backend-option K=V      a backend option, repeatable (e.g. ucx.tls=shm, ucx.tls=tcp\n"
    "                            with ucx.net_devices=lo, ucx.max_inflight_bytes=8M)\n"
    "  --layers L[,L...]         model layers; each has a K and a V buffer (4)\n"
    "  --item-bytes B[,B...]     bytes of one KV page of one buffer (4096)\n"
    "  --pages P[,P...]          KV pages per request (4)\n"
    "  --layout scattered|contiguous[,...]\n"
    "                            scattered: each request's pages are distinct pages at random\n"
    "                            in the pool, drawn independently on each side, so almost no\n"
    "                            write coalesces; contiguous: consecutive pages, one write per\n"
    "                            buffer per request (scattered)\n"
    "  --pool-bytes N            KV pool of each side, all 2 x layers buffers together; k, m, g\n"
    "                            suffixes (1g); pages per buffer = N / (2 x layers x item-bytes)\n"
    "  --pool-pages N            pages per buffer instead (overrides --pool-bytes)\n"
    "  --prefill-tp M            prefill TP ranks, as threads of the prefill process (1)\n"
    "  --decode-tp N             decode TP ranks, as threads of the decode process (1); with\n"
    "                            M != N every page is sliced by heads (SPEC R5.4); item-bytes\n"
    "                            stays the page of the whole model, a rank holds 1/TP of it\n"
    "  --kv-layout hnd|nhd       page layout: [head][token][dim] or [token][head][dim] (hnd);\n"
    "                            an NHD head slice is page-size pieces per page\n"
    "  --kv-heads H              KV heads of the model (8); --page-size T tokens per page (16)\n"
    "  --pool-alloc backend|malloc\n"
    "                            backend: pdlib::AllocateKVPool, which lets the backend allocate\n"
    "                            (UCX maps it for direct shared-memory puts; plain host memory\n"
    "                            for backends without an allocator); malloc: plain malloc\n"
    "                            (backend)\n"
    "\n"
    "How it runs:\n"
    "  --requests R              measured requests (20000)\n"
    "  --warmup W                requests run before them, not measured (500)\n"
    "  --concurrency C[,C...]    requests in flight at decode (256)\n"
    "  --transfer-workers N      prefill's KVManagerOptions::transfer_workers (2)\n"
    "  --room-log-every N        both sides' KVManagerOptions::room_log_every (0: auto); the\n"
    "                            per-room info lines cost only with PDLIB_LOG_LEVEL=info\n"
    "  --in-process              both ranks as threads of this process (in-process control\n"
    "                            plane) instead of two processes over gRPC\n"
    "  --idle-spins N            idle passes that yield before a driver sleeps (64)\n"
    "  --idle-sleep-us N         a driver's first sleep per idle pass afterwards (20); each\n"
    "                            further idle pass sleeps twice as long, up to\n"
    "  --idle-sleep-max-us N     (1000)\n"
    "  --progress-every S        decode prints its progress on stderr every S seconds (5; 0: off)\n"
    "  --seed S                  pages and room ids derive from it (1)\n"
    "  --verify                  decode checks every byte of every request at its Success (a\n"
    "                            correctness run, not for figures; needs --concurrency 1)\n"
    "\n"
    "Comparisons (run after the ranks have exited):\n"
    "  --baseline memcpy         copies the same writes (the same pages, coalesced into the same\n"
    "                            runs, every K and V buffer) with memcpy in one thread between "
    "two\n"
    "                            pools allocated like the ranks', timed like them; adds\n"
    "                            baseline_gbps (Gbit/s, the unit of gbps), baseline_gbytes_per_s\n"
    "                            and ratio = gbps / baseline_gbps\n"
    "  --compare-perftest        runs ucx_perftest -t ucp_put_bw between two processes on\n"
    "                            127.0.0.1 at the most frequent write size, with UCX_TLS,\n"
    "                            UCX_NET_DEVICES and UCX_<NAME> from ucx.tls, ucx.net_devices and\n"
    "                            ucx.config.<NAME> (UCX's defaults otherwise); adds\n"
    "                            perftest_gbytes_per_s (null, with a word on stderr, when\n"
    "                            ucx_perftest is not on PATH)\n"
    "\n"
    "Output:\n"
    "  --json                    one JSON object per configuration instead of a table\n"
    "  --help                    this text\n"
    "\n"
    "Figures (measured at decode): seconds from the first measured CreateReceiver() to the last\n"
    "Success; req_per_s = requests / seconds; p50_us, p99_us, ...: CreateReceiver() to Success\n"
    "per request; decode_cpu_s: CPU seconds of the decode process (all threads) over `seconds`\n"
    "(near zero for the data path when puts land directly, as with UCX shm into a UCX pool);\n"
    "gbps: KV payload (pages x 2 x layers x item-bytes per request) in Gbit/s\n"
    "(10^9 bits), gbytes_per_s: the same in GB/s (10^9 bytes). The fake backend moves no bytes:\n"
    "its figures are the rate at which write batches were validated and completed.\n";

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
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--json") {
      o->json = true;
      continue;
    }
    if (arg == "--in-process") {
      o->in_process = true;
      continue;
    }
    if (arg == "--compare-perftest") {
      o->compare_perftest = true;
      continue;
    }
    if (arg == "--verify") {
      o->base.verify = true;
      continue;
    }
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    std::string_view value;
    if (size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      std::fprintf(stderr, "pdlib-transfer-bench: %s needs a value\n%s", argv[i], kUsage);
      return false;
    }
    uint64_t n = 0;
    bool ok = true;
    BenchConfig& b = o->base;
    if (arg == "--backend") {
      b.backend = value;
    } else if (arg == "--backend-option") {
      const size_t eq = value.find('=');
      ok = eq != std::string_view::npos;
      if (ok) b.backend_options[std::string(value.substr(0, eq))] = value.substr(eq + 1);
    } else if (arg == "--requests") {
      ok = ParseU64(value, &b.requests) && b.requests > 0;
    } else if (arg == "--warmup") {
      ok = ParseU64(value, &b.warmup);
    } else if (arg == "--concurrency") {
      ok = ParseList(value, &o->concurrency);
    } else if (arg == "--pages") {
      ok = ParseList(value, &o->pages);
    } else if (arg == "--layers") {
      ok = ParseList(value, &o->layers);
    } else if (arg == "--item-bytes") {
      ok = ParseList(value, &o->item_bytes);
    } else if (arg == "--prefill-tp" || arg == "--decode-tp") {
      ok = ParseU64(value, &n) && n >= 1 && n <= 64;
      (arg == "--prefill-tp" ? b.prefill_tp : b.decode_tp) = int32_t(n);
    } else if (arg == "--kv-layout") {
      ok = value == "hnd" || value == "nhd";
      b.kv_layout = value == "nhd" ? pdlib::KVLayout::kNHD : pdlib::KVLayout::kHND;
    } else if (arg == "--kv-heads") {
      ok = ParseU64(value, &n) && n >= 1 && n <= 1024;
      b.kv_heads = int32_t(n);
    } else if (arg == "--page-size") {
      ok = ParseU64(value, &n) && n >= 1 && n <= 4096;
      b.page_size = uint32_t(n);
    } else if (arg == "--pool-pages") {
      ok = ParseU64(value, &b.pool_pages);
    } else if (arg == "--pool-bytes") {
      ok = ParseBytes(value, &b.pool_bytes);
    } else if (arg == "--pool-alloc") {
      ok = value == "backend" || value == "malloc";
      b.pool_alloc = value == "malloc" ? PoolAlloc::kMalloc : PoolAlloc::kBackend;
    } else if (arg == "--baseline") {
      ok = value == "memcpy" || value == "none";
      o->baseline_memcpy = value == "memcpy";
    } else if (arg == "--progress-every") {
      char* end = nullptr;
      const std::string v(value);
      b.progress_every_s = std::strtod(v.c_str(), &end);
      ok = end == v.c_str() + v.size() && b.progress_every_s >= 0;
    } else if (arg == "--layout") {
      o->layouts.clear();
      for (std::string_view rest = value; ok && !rest.empty();) {
        const size_t comma = rest.find(',');
        const std::string_view name = rest.substr(0, comma);
        ok = name == "scattered" || name == "contiguous";
        o->layouts.push_back(name == "scattered" ? Layout::kScattered : Layout::kContiguous);
        rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
      }
      ok = ok && !o->layouts.empty();
    } else if (arg == "--transfer-workers") {
      ok = ParseU64(value, &n) && n >= 1 && n <= 64;
      b.transfer_workers = int32_t(n);
    } else if (arg == "--room-log-every") {
      ok = ParseU64(value, &n) && n <= UINT32_MAX;
      b.room_log_every = uint32_t(n);
    } else if (arg == "--idle-spins") {
      ok = ParseU64(value, &b.idle_spins);
    } else if (arg == "--idle-sleep-us") {
      ok = ParseU64(value, &b.idle_sleep_us);
    } else if (arg == "--idle-sleep-max-us") {
      ok = ParseU64(value, &b.idle_sleep_max_us);
    } else if (arg == "--seed") {
      ok = ParseU64(value, &b.seed);
    } else if (arg == "--role") {
      o->role = value;
      ok = value == "prefill" || value == "decode";
    } else if (arg == "--bootstrap-port") {
      ok = ParseU64(value, &n) && n > 0 && n < 65536;
      b.bootstrap_port = uint16_t(n);
    } else {
      std::fprintf(stderr, "pdlib-transfer-bench: unknown option %s\n%s", argv[i], kUsage);
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "pdlib-transfer-bench: bad value '%.*s' for %.*s\n", int(value.size()),
                   value.data(), int(arg.size()), arg.data());
      return false;
    }
  }
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
                                std::to_string(c.bootstrap_port)};
  if (c.verify) a.push_back("--verify");
  for (const auto& [k, v] : c.backend_options) {
    a.push_back("--backend-option");
    a.push_back(k + "=" + v);
  }
  return a;
}

}  // namespace pdlib_bench
