// pdlib-transfer-bench: requests per second and latency of whole KV transfers through pdlib's
// public API, between a prefill and a decode process (or two threads with --in-process).
//
//   pdlib-transfer-bench [--backend fake|ucx|verbs] [--backend-option KEY=VALUE]...
//       [--requests R] [--warmup W] [--concurrency C] [--layers L] [--item-bytes B]
//       [--pages P] [--pool-pages N] [--layout scattered|contiguous] [--json] [--in-process]
//       [--transfer-workers N] [--idle-spins N] [--idle-sleep-us N] [--seed S]
//
//   e.g.  pdlib-transfer-bench --backend fake --requests 20000 --concurrency 256 --json
//         pdlib-transfer-bench --concurrency 1,16,256 --pages 4,64 --layout contiguous
//
// Defaults: fake backend, 20000 requests after 500 warm-up ones, concurrency 256, 4 layers (a K
// and a V buffer each), 4096-byte pages, 4 pages per request, scattered layout, pool pages
// max(256, concurrency * pages), 2 transfer workers.
//
// --concurrency, --pages, --layers, --item-bytes and --layout take comma-separated lists; every
// combination is one configuration, run with fresh processes and reported as one table row (or,
// with --json, one JSON object per line on stdout). Per configuration the parent starts the
// prefill process (which hosts the bootstrap server on a free port), waits for its READY, starts
// the decode process, and collects both results. Neither process coordinates with the other per
// request: both derive room ids and pages from the seed and the request index. Before the
// warm-up, decode probes until a receiver connects (prefill's registration with its bootstrap
// server may complete just after its READY).
//
// What is measured (at decode): `requests` requests after `warmup` unmeasured ones, at most
// `concurrency` in flight. seconds: first measured CreateReceiver() to last Success.
// req_per_s = requests / seconds. p50_us / p99_us: per request, CreateReceiver() to Success as
// seen by the driver's poll loop. gbps: KV payload (pages * 2 * layers * item_bytes per request)
// in gigabits per second; gbytes_per_s: the same in gigabytes per second. The fake backend moves no
// bytes, so its gbps is only the rate at which write batches were validated and completed. layout
// scattered: each request's pages are distinct random pages of the pool (on each side
// independently, so almost no run coalesces); contiguous: consecutive pages (one write per buffer
// per request).
//
// The drivers poll their handles in a tight loop and, after --idle-spins passes without
// progress, sleep --idle-sleep-us per pass, so that on a small machine they leave the CPU to
// pdlib's own threads. Exit status: 0 when every configuration ran with no failed request.
#include <signal.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench/transfer/bench_ranks.h"
#include "bench/transfer/child_process.h"

namespace pdlib_bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Options {
  BenchConfig base;
  std::vector<uint64_t> concurrency{256}, pages{4}, layers{4}, item_bytes{4096};
  std::vector<Layout> layouts{Layout::kScattered};
  bool json = false;
  bool in_process = false;
  std::string role;  // hidden: "prefill" or "decode" in the child processes
};

constexpr char kUsage[] =
    "usage: pdlib-transfer-bench [--backend NAME] [--backend-option KEY=VALUE]...\n"
    "    [--requests R] [--warmup W] [--concurrency C[,C...]] [--layers L[,L...]]\n"
    "    [--item-bytes B[,B...]] [--pages P[,P...]] [--pool-pages N]\n"
    "    [--layout scattered|contiguous[,...]] [--json] [--in-process]\n"
    "    [--transfer-workers N] [--idle-spins N] [--idle-sleep-us N] [--seed S]\n";

bool ParseU64(std::string_view text, uint64_t* out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
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
    } else if (arg == "--pool-pages") {
      ok = ParseU64(value, &b.pool_pages);
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
    } else if (arg == "--idle-spins") {
      ok = ParseU64(value, &b.idle_spins);
    } else if (arg == "--idle-sleep-us") {
      ok = ParseU64(value, &b.idle_sleep_us);
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

// The flags that make a child process run `c` (the parent's view of one configuration).
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
                                std::to_string(c.pool_pages),
                                "--layout",
                                std::string(LayoutName(c.layout)),
                                "--transfer-workers",
                                std::to_string(c.transfer_workers),
                                "--idle-spins",
                                std::to_string(c.idle_spins),
                                "--idle-sleep-us",
                                std::to_string(c.idle_sleep_us),
                                "--seed",
                                std::to_string(c.seed),
                                "--bootstrap-port",
                                std::to_string(c.bootstrap_port)};
  for (const auto& [k, v] : c.backend_options) {
    a.push_back("--backend-option");
    a.push_back(k + "=" + v);
  }
  return a;
}

// Percentiles etc. of one decode run.
struct Summary {
  double p50 = 0, p99 = 0, p999 = 0, mean = 0, max = 0;
};

Summary Summarize(std::vector<uint32_t> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return double(v[std::min(v.size() - 1, size_t(q * v.size()))]); };
  s.p50 = at(0.50);
  s.p99 = at(0.99);
  s.p999 = at(0.999);
  s.max = v.back();
  double sum = 0;
  for (uint32_t x : v) sum += x;
  s.mean = sum / double(v.size());
  return s;
}

// One line "RESULT key=value ..." for the parent; first_failure goes last, verbatim.
std::string ResultLine(const RankResult& r) {
  const Summary s = Summarize(r.latencies_us);
  std::ostringstream out;
  out << "RESULT error=" << (r.error.empty() ? "none" : "yes") << " succeeded=" << r.succeeded
      << " failed=" << r.failed << " seconds=" << r.seconds << " p50=" << s.p50 << " p99=" << s.p99
      << " p999=" << s.p999 << " mean=" << s.mean << " max=" << s.max
      << " bytes=" << r.metrics.bytes_transferred << " batches=" << r.metrics.write_batches
      << " why=" << (r.error.empty() ? r.first_failure : r.error);
  return out.str();
}

std::map<std::string, std::string> ParseResult(const std::string& line) {
  std::map<std::string, std::string> m;
  std::string_view rest = line;
  if (rest.starts_with("RESULT ")) rest.remove_prefix(7);
  if (size_t why = rest.find(" why="); why != std::string_view::npos) {
    m["why"] = rest.substr(why + 5);
    rest = rest.substr(0, why);
  }
  std::istringstream in{std::string(rest)};
  for (std::string tok; in >> tok;) {
    if (size_t eq = tok.find('='); eq != std::string::npos)
      m[tok.substr(0, eq)] = tok.substr(eq + 1);
  }
  return m;
}

void Emit(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// The child side: one rank, reporting on stdout.
int RunChild(const Options& o) {
  const BenchConfig& c = o.base;
  RankResult r;
  if (o.role == "prefill") {
    r = RunPrefillRank(
        c, /*start_bootstrap=*/true, [](const std::string& ep) { Emit("READY " + ep); },
        [](const RankResult& done) {
          Emit(ResultLine(done));
          // Stay up until the parent has the decode side's result too.
          std::string line;
          while (std::getline(std::cin, line) && line != "QUIT") {
          }
        });
    // A rank that failed before serving never reached before_teardown.
    if (!r.error.empty()) Emit(ResultLine(r));
  } else {
    r = RunDecodeRank(c, [] { Emit("READY"); });
    Emit(ResultLine(r));
  }
  return r.error.empty() ? 0 : 1;
}

// Runs one configuration in two child processes; returns the decode side's result fields (with
// "error" set on failure) and the prefill side's in `prefill`.
std::map<std::string, std::string> RunTwoProcesses(BenchConfig c,
                                                   std::map<std::string, std::string>* prefill) {
  // Generous bounds; a healthy run needs a fraction of them.
  const auto start_deadline = Clock::now() + std::chrono::seconds(30);
  const auto run_deadline = Clock::now() + std::chrono::seconds(60 + (c.requests + c.warmup) / 200);
  for (int attempt = 0; attempt < 3; ++attempt) {
    c.bootstrap_port = UnusedLocalPort();
    ChildProcess p(ChildArgs(c, "prefill"));
    if (!p.started()) return {{"error", "yes"}, {"why", "cannot start the prefill process"}};
    // READY, or a RESULT that says why the rank could not start.
    std::optional<std::string> first;
    do {
      first = p.Expect("", start_deadline);
    } while (first && !first->starts_with("READY") && !first->starts_with("RESULT "));
    if (!first) return {{"error", "yes"}, {"why", "prefill process never became ready"}};
    if (first->starts_with("RESULT ")) {
      auto failed = ParseResult(*first);
      // The bootstrap port may have been taken since we picked it: try another one.
      if (failed["why"].find("bootstrap server") != std::string::npos) continue;
      return {{"error", "yes"}, {"why", "prefill: " + failed["why"]}};
    }
    ChildProcess d(ChildArgs(c, "decode"));
    if (!d.started()) return {{"error", "yes"}, {"why", "cannot start the decode process"}};
    auto dres = d.Expect("RESULT ", run_deadline);
    auto pres = p.Expect("RESULT ", dres ? run_deadline : Clock::now());
    p.Send("QUIT");
    // The figures are in; a process that then fails to exit cleanly is still worth a word.
    const int dcode = d.Wait(Clock::now() + std::chrono::seconds(10));
    const int pcode = p.Wait(Clock::now() + std::chrono::seconds(10));
    if (dcode != 0 || pcode != 0) {
      std::fprintf(stderr,
                   "pdlib-transfer-bench: warning: decode exited with status %d, prefill with "
                   "%d (-1: still running, killed)\n",
                   dcode, pcode);
    }
    if (pres) *prefill = ParseResult(*pres);
    if (!dres) return {{"error", "yes"}, {"why", "no result from the decode process in time"}};
    return ParseResult(*dres);
  }
  return {{"error", "yes"}, {"why", "prefill process failed to start three times"}};
}

// Runs one configuration in this process (two threads, in-process control plane).
std::map<std::string, std::string> RunInProcess(BenchConfig c,
                                                std::map<std::string, std::string>* prefill) {
  c.control_plane = pdlib::ControlPlane::kInProcess;
  c.bootstrap_port = uint16_t(20000 + (c.seed % 20000));
  std::mutex mu;
  std::condition_variable cv;
  bool prefill_ready = false, decode_done = false;
  RankResult pr;
  std::thread prefill_thread([&] {
    pr = RunPrefillRank(
        c, false,
        [&](const std::string&) {
          std::lock_guard lock(mu);
          prefill_ready = true;
          cv.notify_all();
        },
        [&](const RankResult&) {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return decode_done; });
        });
    std::lock_guard lock(mu);
    prefill_ready = true;  // also when it failed before becoming ready
    cv.notify_all();
  });
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return prefill_ready; });
  }
  RankResult dr;
  if (pr.error.empty()) dr = RunDecodeRank(c, [] {});
  {
    std::lock_guard lock(mu);
    decode_done = true;
    cv.notify_all();
  }
  prefill_thread.join();
  *prefill = ParseResult(ResultLine(pr));
  if (!pr.error.empty()) dr.error = "prefill: " + pr.error;
  return ParseResult(ResultLine(dr));
}

std::string JsonEscape(std::string_view s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out;
}

double Num(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? 0.0 : std::strtod(it->second.c_str(), nullptr);
}

// Prints one configuration's outcome; returns false when it failed.
bool Report(const Options& o, const BenchConfig& c, const std::map<std::string, std::string>& d,
            const std::map<std::string, std::string>& p, bool first_row) {
  const bool error = d.count("error") && d.at("error") != "none";
  const double seconds = Num(d, "seconds");
  const double ok = Num(d, "succeeded");
  const double req_per_s = seconds > 0 ? ok / seconds : 0;
  const double gbps = seconds > 0 ? ok * double(c.BytesPerRequest()) * 8 / seconds / 1e9 : 0;
  const std::string plane = o.in_process ? "in_process" : "grpc";
  const std::string why = d.count("why") ? d.at("why") : "";
  char buf[2048];
  if (o.json) {
    std::snprintf(buf, sizeof(buf),
                  "{\"backend\":\"%s\",\"transport\":\"%s\",\"control_plane\":\"%s\","
                  "\"layers\":%" PRIu64 ",\"item_bytes\":%" PRIu64 ",\"pages\":%" PRIu64
                  ",\"layout\":\"%s\",\"requests\":%" PRIu64 ",\"warmup\":%" PRIu64
                  ",\"concurrency\":%" PRIu64
                  ",\"seconds\":%.4f,\"gbps\":%.3f,\"gbytes_per_s\":%.3f,\"req_per_s\":%.0f,"
                  "\"p50_us\":%.0f,"
                  "\"p99_us\":%.0f,\"p999_us\":%.0f,\"mean_us\":%.1f,\"max_us\":%.0f,"
                  "\"succeeded\":%.0f,\"failed\":%.0f,\"prefill_write_batches\":%.0f,"
                  "\"error\":%s%s%s}",
                  JsonEscape(c.backend).c_str(), JsonEscape(c.Transport()).c_str(), plane.c_str(),
                  c.layers, c.item_bytes, c.pages, std::string(LayoutName(c.layout)).c_str(),
                  c.requests, c.warmup, c.concurrency, seconds, gbps, gbps / 8, req_per_s,
                  Num(d, "p50"), Num(d, "p99"), Num(d, "p999"), Num(d, "mean"), Num(d, "max"), ok,
                  Num(d, "failed"), Num(p, "batches"), (error || Num(d, "failed") > 0) ? "\"" : "",
                  (error || Num(d, "failed") > 0) ? JsonEscape(why).c_str() : "null",
                  (error || Num(d, "failed") > 0) ? "\"" : "");
    Emit(buf);
  } else {
    if (first_row) {
      Emit(
          "backend    transport  plane       layers item_bytes pages layout     requests  conc"
          "   seconds    Gbit/s    req/s  p50_us  p99_us failed");
    }
    std::snprintf(buf, sizeof(buf),
                  "%-10s %-10s %-11s %6" PRIu64 " %10" PRIu64 " %5" PRIu64 " %-10s %8" PRIu64
                  " %5" PRIu64 " %9.3f %9.3f %8.0f %7.0f %7.0f %6.0f",
                  c.backend.c_str(), c.Transport().c_str(), plane.c_str(), c.layers, c.item_bytes,
                  c.pages, std::string(LayoutName(c.layout)).c_str(), c.requests, c.concurrency,
                  seconds, gbps, req_per_s, Num(d, "p50"), Num(d, "p99"), Num(d, "failed"));
    Emit(buf);
  }
  if (error || Num(d, "failed") > 0) {
    std::fprintf(stderr, "pdlib-transfer-bench: %s: %s\n", error ? "error" : "first failure",
                 why.c_str());
  }
  return !error && Num(d, "failed") == 0;
}

}  // namespace
}  // namespace pdlib_bench

int main(int argc, char** argv) {
  using namespace pdlib_bench;
  ::signal(SIGPIPE, SIG_IGN);  // a child that died must not take the parent with it
  Options o;
  if (!ParseArgs(argc, argv, &o)) return 2;
  // Failed rooms are counted and the first reason reported; pdlib's own warnings (e.g. for the
  // probe receivers) would only interleave with the results.
  if (std::getenv("PDLIB_LOG_LEVEL") == nullptr) pdlib::SetLogLevel(pdlib::LogLevel::kError);
  if (!o.role.empty()) {
    // A child runs exactly one configuration: the first of each list.
    o.base.concurrency = o.concurrency.front();
    o.base.pages = o.pages.front();
    o.base.layers = o.layers.front();
    o.base.item_bytes = o.item_bytes.front();
    o.base.layout = o.layouts.front();
    return RunChild(o);
  }

  bool all_ok = true, first = true;
  for (uint64_t layers : o.layers) {
    for (uint64_t item : o.item_bytes) {
      for (uint64_t pages : o.pages) {
        for (Layout layout : o.layouts) {
          for (uint64_t conc : o.concurrency) {
            BenchConfig c = o.base;
            c.layers = layers;
            c.item_bytes = item;
            c.pages = pages;
            c.layout = layout;
            c.concurrency = conc;
            std::map<std::string, std::string> prefill;
            auto decode = o.in_process ? RunInProcess(c, &prefill) : RunTwoProcesses(c, &prefill);
            all_ok &= Report(o, c, decode, prefill, first);
            first = false;
          }
        }
      }
    }
  }
  return all_ok ? 0 : 1;
}
