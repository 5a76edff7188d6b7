// pdlib-transfer-bench: requests per second, latency and bandwidth of whole KV transfers through
// pdlib's public API, between a prefill and a decode process (or two threads with --in-process),
// optionally next to a memcpy of the same writes (--baseline memcpy) and to ucx_perftest
// (--compare-perftest). With --memory cuda both pools are GPU memory (cuda_memory.h) and the
// baseline is cudaMemcpy device to device. With --decode-prefix R decode holds the first
// floor(R x pages) pages of each request and only the rest moves (issue #27); R > 0 also runs R = 0
// and reports both with their ratios. With --direction pull decode reads prefill's published pages
// (issue #29); --direction both runs push then pull per configuration and reports pull over push.
// `--help` documents every flag and every figure.
//
//   e.g.  pdlib-transfer-bench --backend fake --requests 20000 --concurrency 256 --json
//         pdlib-transfer-bench --backend ucx --backend-option ucx.tls=shm --layers 32
//             --item-bytes 32768 --pages 16 --requests 64 --concurrency 4 --baseline memcpy --json
//
// --concurrency, --pages, --layers, --item-bytes and --layout take comma-separated lists; every
// combination is one configuration, run with fresh processes and reported as one table row (or,
// with --json, one JSON object per line on stdout). Per configuration the parent starts the
// prefill process (which hosts the bootstrap server on a free port), waits for its READY, starts
// the decode process, and collects both results; then it runs the baseline and perftest, if
// asked, with the ranks gone. Neither rank coordinates with the other per request: both derive
// room ids and pages from the seed and the request index (bench_layout.h). Before the warm-up,
// decode probes until a receiver connects (prefill's registration with its bootstrap server may
// complete just after its READY). A run is bounded by its progress, not its length: decode says
// every second how many requests ended, and the parent gives up on a configuration only when none
// did for --stall_timeout, naming the oldest request in flight and its state.
//
// The drivers poll their handles in a tight loop and, after --idle-spins passes without
// progress, sleep between passes (from --idle-sleep-us, doubling up to --idle-sleep-max-us), so
// that on a small machine they leave the CPU to pdlib's own threads. Exit status: 0 when every
// configuration ran with no failed request.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "bench/transfer/baseline.h"
#include "bench/transfer/bench_args.h"
#include "bench/transfer/bench_ranks.h"
#include "bench/transfer/cuda_memory.h"
#include "bench/transfer/iperf3.h"
#include "bench/transfer/perftest.h"
#include "tools/common/child_process.h"
#include "tools/netns/netns_cluster.h"

namespace pdlib_bench {

using pdlib_tools::ChildProcess;
using pdlib_tools::UnusedLocalPort;
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The exit status when --netns cannot build its hosts here (ctest's SKIP_RETURN_CODE).
constexpr int kCannotRunHere = 77;

// --netns: hosts "prefill" and "decode", for the whole run (main's).
pdlib_tools::NetnsCluster* g_cluster = nullptr;

// A child process of role `role`, in its host with --netns.
std::unique_ptr<ChildProcess> StartChild(const BenchConfig& c, const std::string& role) {
  pdlib_tools::ChildOptions co{.self_name = "pdlib-transfer-bench", .args = ChildArgs(c, role)};
  if (g_cluster != nullptr) {
    auto in_host = g_cluster->InHost(role, co);
    if (!in_host.ok()) {
      std::fprintf(stderr, "pdlib-transfer-bench: %s\n", in_host.status().ToString().c_str());
      return nullptr;
    }
    co = std::move(*in_host);
  }
  auto child = std::make_unique<ChildProcess>(std::move(co));
  return child->started() ? std::move(child) : nullptr;
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
  const Summary e = Summarize(r.exposed_us);
  std::ostringstream out;
  out << "RESULT error=" << (r.error.empty() ? "none" : "yes") << " succeeded=" << r.succeeded
      << " failed=" << r.failed << " wrong=" << r.wrong << " seconds=" << r.seconds
      << " cpu=" << r.cpu_seconds << " p50=" << s.p50 << " p99=" << s.p99 << " p999=" << s.p999
      << " mean=" << s.mean << " max=" << s.max << " exposed_n=" << r.exposed_us.size()
      << " exposed_mean=" << e.mean << " exposed_p50=" << e.p50 << " exposed_p99=" << e.p99
      << " bytes=" << r.metrics.bytes_transferred << " batches=" << r.metrics.write_batches
      << " pool=" << (r.pool_allocator.empty() ? "none" : r.pool_allocator)
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
  static std::mutex mu;  // decode's PROGRESS reporter writes from a thread of its own
  std::lock_guard<std::mutex> lock(mu);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// The child side: one rank, reporting on stdout.
int RunChild(const Options& o) {
  const BenchConfig& c = o.base;
  RankResult r;
  if (o.role == "prefill") {
    r = RunPrefillRanks(
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
    // "PROGRESS <requests ended> <the oldest in flight>" every second, for the parent's stall
    // clock (AwaitDecodeResult).
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::thread reporter([&] {
      std::unique_lock<std::mutex> lock(mu);
      while (!cv.wait_for(lock, std::chrono::seconds(1), [&] { return done; })) {
        const DecodeProgress p = CurrentDecodeProgress();
        Emit("PROGRESS " + std::to_string(p.ended) + " " + p.oldest);
      }
    });
    r = RunDecodeRanks(c, [] { Emit("READY"); });
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_one();
    reporter.join();
    Emit(ResultLine(r));
  }
  return r.error.empty() ? 0 : 1;
}

std::vector<uint64_t> DecodeRailRxBytes();

// --rail-fault: on its own thread while decode runs (from decode's READY): partitions the rail
// at its time, heals it, and samples decode's received bytes (all rails) every 100 ms.
void RunRailFault(const Options::RailFault& f, const std::atomic<bool>* stop,
                  BenchConfig::FaultFigures* out,
                  std::vector<std::pair<double, uint64_t>>* samples) {
  const auto t0 = Clock::now();
  auto ms = [&] { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); };
  bool cut = false, healed = false;
  auto next = t0;
  while (!stop->load()) {
    if (!cut && ms() >= f.at_ms) {
      if (pdlib::Status s = g_cluster->PartitionRail("decode", f.rail); !s.ok()) {
        out->error = s.ToString();
      }
      cut = true;
      out->fault_at_ms = ms();
    }
    if (cut && !healed && ms() >= f.at_ms + f.for_ms) {
      if (pdlib::Status s = g_cluster->HealRail("decode", f.rail); !s.ok())
        out->error = s.ToString();
      healed = true;
      out->heal_at_ms = ms();
    }
    const std::vector<uint64_t> rx = DecodeRailRxBytes();
    uint64_t sum = 0;
    for (uint64_t b : rx) sum += b;
    samples->emplace_back(ms(), sum);
    next += milliseconds(100);
    std::this_thread::sleep_until(next);
  }
  if (cut && !healed) {
    g_cluster->HealRail("decode", f.rail).IgnoreError();
    out->heal_at_ms = ms();
  }
}

// The figures of a faulted row from its samples.
void SummarizeFault(const std::vector<std::pair<double, uint64_t>>& samples,
                    BenchConfig::FaultFigures* f) {
  auto gbps = [](uint64_t bytes, double ms) { return ms > 0 ? double(bytes) * 8 / ms / 1e6 : 0; };
  // Mean rate over the samples whose window ends in (from, to].
  auto mean = [&](double from, double to) {
    uint64_t bytes = 0;
    double ms = 0;
    for (size_t i = 1; i < samples.size(); ++i) {
      if (samples[i].first <= from || samples[i].first > to) continue;
      bytes += samples[i].second - samples[i - 1].second;
      ms += samples[i].first - samples[i - 1].first;
    }
    return gbps(bytes, ms);
  };
  for (size_t i = 1; i < samples.size(); ++i) {
    f->timeline.emplace_back(samples[i].first, gbps(samples[i].second - samples[i - 1].second,
                                                    samples[i].first - samples[i - 1].first));
  }
  f->before_gbps = mean(std::max(0.0, f->fault_at_ms - 2000), f->fault_at_ms);
  f->during_gbps = mean(f->fault_at_ms, f->heal_at_ms);
  f->after_gbps = mean(f->heal_at_ms, f->heal_at_ms + 2000);
  for (const auto& [t, rate] : f->timeline) {
    if (t - 100 >= f->heal_at_ms && rate >= 0.9 * f->before_gbps) {
      f->recovery_ms = t - 100 - f->heal_at_ms;
      break;
    }
  }
}

// Decode's RESULT line. Until its READY (unless `ready`: already read) it has until `ready_by`;
// then its PROGRESS lines (RunChild) say how many requests ended. Nullopt once none ended for
// `stall` or its output closed, with *why saying which and, for a stall, which request waited
// longest and in what state.
std::optional<std::string> AwaitDecodeResult(ChildProcess& d, std::chrono::duration<double> stall,
                                             bool ready, Clock::time_point ready_by,
                                             std::string* why) {
  const auto window = std::chrono::duration_cast<Clock::duration>(stall);
  auto deadline = ready ? Clock::now() + window : std::max(ready_by, Clock::now() + window);
  uint64_t ended = 0;
  std::string oldest;
  while (true) {
    auto line = d.ReadLine(deadline);
    if (!line) break;
    if (line->starts_with("RESULT ")) return line;
    if (line->starts_with("READY")) {
      ready = true;
      deadline = Clock::now() + window;
    } else if (line->starts_with("PROGRESS ")) {
      std::istringstream in(line->substr(9));
      uint64_t n = 0;
      in >> n;
      std::getline(in >> std::ws, oldest);
      if (n > ended) {
        ended = n;
        deadline = Clock::now() + window;
      }
    }
  }
  if (Clock::now() < deadline) {
    *why = "the decode process exited without a result (" + std::to_string(ended) +
           " requests had ended)";
  } else if (!ready) {
    *why = "the decode process never became ready (it could not reach prefill)";
  } else {
    char text[96];
    std::snprintf(text, sizeof text, "no request ended for %.0f s (--stall_timeout); ",
                  stall.count());
    *why = text + std::to_string(ended) +
           " requests ended before; the oldest in flight: " + (oldest.empty() ? "none" : oldest);
  }
  return std::nullopt;
}

// Runs one configuration in two child processes; returns the decode side's result fields (with
// "error" set on failure) and the prefill side's in `prefill`. With `fault` (--rail-fault), the
// rail is partitioned and healed meanwhile and c->fault gets the figures.
std::map<std::string, std::string> RunTwoProcesses(BenchConfig* config,
                                                   std::map<std::string, std::string>* prefill,
                                                   const Options::RailFault* fault,
                                                   double stall_timeout_s) {
  BenchConfig& c = *config;
  // Starting is bounded; the run itself by its progress (AwaitDecodeResult, --stall_timeout), not
  // by its length: a slow or loaded machine (Soft-RoCE under emulation) takes longer, a hang
  // makes no progress.
  const auto start_deadline = Clock::now() + std::chrono::seconds(30);
  const std::chrono::duration<double> stall(stall_timeout_s);
  for (int attempt = 0; attempt < 3; ++attempt) {
    c.bootstrap_port = UnusedLocalPort();
    auto prefill_child = StartChild(c, "prefill");
    if (!prefill_child) return {{"error", "yes"}, {"why", "cannot start the prefill process"}};
    ChildProcess& p = *prefill_child;
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
    auto decode_child = StartChild(c, "decode");
    if (!decode_child) return {{"error", "yes"}, {"why", "cannot start the decode process"}};
    ChildProcess& d = *decode_child;
    std::atomic<bool> stop{false};
    std::thread faulting;
    std::vector<std::pair<double, uint64_t>> samples;
    if (fault != nullptr) {
      c.fault.emplace();
      c.fault->rail = fault->rail;
      c.fault->at_ms = fault->at_ms;
      c.fault->for_ms = fault->for_ms;
      if (d.Expect("READY", start_deadline)) {
        faulting = std::thread(RunRailFault, *fault, &stop, &*c.fault, &samples);
      } else {
        c.fault->error = "decode never became ready";
      }
    }
    std::string stalled;
    auto dres = AwaitDecodeResult(d, stall, fault != nullptr, start_deadline, &stalled);
    if (faulting.joinable()) {
      stop = true;
      faulting.join();
      SummarizeFault(samples, &*c.fault);
    }
    if (!dres) {
      // Stalled (or decode died): nothing more is coming from either rank.
      d.KillAndReap(std::chrono::seconds(5));
      p.KillAndReap(std::chrono::seconds(5));
      return {{"error", "yes"}, {"why", "no result from the decode process: " + stalled}};
    }
    // Prefill reports once its last request ended, which is before decode's did.
    auto pres = p.Expect("RESULT ", Clock::now() + std::chrono::seconds(30));
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
    pr = RunPrefillRanks(
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
  if (pr.error.empty()) dr = RunDecodeRanks(c, [] {});
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

double Num(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? 0.0 : std::strtod(it->second.c_str(), nullptr);
}

// What --baseline and --compare-perftest add to a configuration's row.
struct Comparisons {
  std::optional<BaselineResult> baseline;
  bool perftest_asked = false;
  uint64_t perftest_message_bytes = 0;
  std::optional<double> perftest_gbytes_per_s;
  bool iperf3_asked = false;
  std::optional<double> iperf3_gbps;
};

// Runs the comparisons asked for `c`; says on stderr what could not run.
Comparisons Compare(const Options& o, const BenchConfig& c) {
  Comparisons cmp;
  if (o.baseline_memcpy) {
    cmp.baseline = RunMemcpyBaseline(c);
    if (!cmp.baseline->error.empty()) {
      std::fprintf(stderr, "pdlib-transfer-bench: %s\n", cmp.baseline->error.c_str());
    }
  }
  if (o.compare_perftest) {
    cmp.perftest_asked = true;
    cmp.perftest_message_bytes = TypicalWriteBytes(c, RequestRuns(c));
    if (!OnPath("ucx_perftest")) {
      std::fprintf(stderr,
                   "pdlib-transfer-bench: --compare-perftest: ucx_perftest is not on PATH "
                   "(Debian: apt-get install ucx-utils); perftest_gbytes_per_s is null\n");
    } else {
      const uint64_t total = c.requests * c.BytesPerRequest();
      const uint64_t iterations =
          std::clamp<uint64_t>(total / cmp.perftest_message_bytes, 10000, 1000000);
      PerftestResult r = RunUcxPerftest(cmp.perftest_message_bytes, iterations,
                                        PerftestEnvironment(c.backend_options));
      cmp.perftest_gbytes_per_s = r.gbytes_per_s;
      if (!r.gbytes_per_s) {
        std::fprintf(stderr, "pdlib-transfer-bench: ucx_perftest: %s\n", r.why.c_str());
      }
    }
  }
  if (o.compare_iperf3) {
    cmp.iperf3_asked = true;
    const std::string server_ip =
        g_cluster != nullptr ? g_cluster->FindHost("decode")->ip : std::string("127.0.0.1");
    Iperf3Result r = RunIperf3(g_cluster, "decode", server_ip, "prefill", 5);
    cmp.iperf3_gbps = r.gbps;
    if (!r.gbps) std::fprintf(stderr, "pdlib-transfer-bench: iperf3: %s\n", r.why.c_str());
  }
  return cmp;
}

// The figures of a row that later rows of this run are compared with: the same shape without a
// decode prefix (--decode-prefix 0) for a row with one, and the push row of the same
// configuration for a pull row (--direction both).
struct RowFigures {
  uint64_t kv_bytes_per_request = 0;
  double us_per_request = 0;
  double mean_us = 0;
  double gbps = 0;
  double batches_per_request = 0;  // of the side that moved the bytes
};

// One configuration's JSON object (nlohmann-json; fields in the order they are set).
class JsonObject {
 public:
  void Str(const char* key, std::string_view v) { j_[key] = v; }
  // `v` rounded to `precision` decimals; an integer when `precision` is 0.
  void Num(const char* key, double v, int precision) {
    if (precision == 0) {
      j_[key] = static_cast<int64_t>(std::llround(v));
    } else {
      const double scale = std::pow(10.0, precision);
      j_[key] = std::round(v * scale) / scale;
    }
  }
  void Int(const char* key, uint64_t v) { j_[key] = v; }
  void Ints(const char* key, const std::vector<uint64_t>& v) { j_[key] = v; }
  void Null(const char* key) { j_[key] = nullptr; }
  std::string Close() { return j_.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

 private:
  nlohmann::ordered_json j_;
};

// The row a --rails row is compared with: the first rail count of the list, same configuration.
struct RailsBase {
  int rails = 1;
  double gbps = 0;
};

// Prints one configuration's outcome; returns false when it failed.
// `reference`: with a decode prefix > 0, the same shape at prefix 0 from this run (when that row
// succeeded); `push`: for a pull row, the push row of the same configuration from this run (when
// it succeeded); `rails_base`: for a --rails row after the first, the first's (when it
// succeeded); `*figures` receives this row's, for the rows after it.
bool Report(const Options& o, const BenchConfig& c, const std::map<std::string, std::string>& d,
            const std::map<std::string, std::string>& p, const Comparisons& cmp, bool first_row,
            const std::optional<RowFigures>& reference, const std::optional<RowFigures>& push,
            const std::optional<RailsBase>& rails_base, RowFigures* figures) {
  const bool error = d.count("error") && d.at("error") != "none";
  // --failures_ok: failed requests are reported, not fatal; wrong bytes always are.
  const bool failed = error || Num(d, "wrong") > 0 || (Num(d, "failed") > 0 && !o.failures_ok);
  const double seconds = Num(d, "seconds");
  const double ok = Num(d, "succeeded");
  const double req_per_s = seconds > 0 ? ok / seconds : 0;
  const double gbps = seconds > 0 ? ok * double(c.BytesPerRequest()) * 8 / seconds / 1e9 : 0;
  // Per request: the KV payload that moves (the pages after decode's prefix), what the side
  // that moves the bytes counted (bytes_transferred over warm-up and measured requests: prefill's
  // writes in push, decode's reads in pull) and its batches, and the wall time (seconds /
  // succeeded).
  const bool pull = c.direction == pdlib::TransferDirection::kPull;
  const std::map<std::string, std::string>& mover = pull ? d : p;
  const uint64_t kv_bytes = c.BytesPerRequest();
  const double moved_bytes = Num(mover, "bytes") / double(c.warmup + c.requests);
  const double batches_per_request = Num(mover, "batches") / double(c.warmup + c.requests);
  const double us_per_request = ok > 0 ? seconds * 1e6 / ok : 0;
  *figures = {kv_bytes, us_per_request, Num(d, "mean"), gbps, batches_per_request};
  std::optional<RowFigures> vs_push;
  if (push && push->gbps > 0 && push->us_per_request > 0 && push->mean_us > 0 && !failed) {
    vs_push = push;
  }
  std::optional<RowFigures> ref;
  if (reference && reference->kv_bytes_per_request > 0 && reference->us_per_request > 0 &&
      reference->mean_us > 0 && !failed) {
    ref = reference;
  }
  std::optional<double> baseline_gbps;
  if (cmp.baseline && cmp.baseline->error.empty() && cmp.baseline->seconds > 0) {
    baseline_gbps = double(cmp.baseline->bytes) * 8 / cmp.baseline->seconds / 1e9;
  }
  const std::string plane = o.in_process ? "in_process" : "grpc";
  const std::string direction(pdlib::TransferDirectionName(c.direction));
  const std::string why = d.count("why") ? d.at("why") : "";
  const std::string pool = d.count("pool") ? d.at("pool") : "none";
  std::optional<RailsBase> vs_rails;
  if (rails_base && rails_base->gbps > 0 && !failed) vs_rails = rails_base;
  if (o.json) {
    JsonObject j;
    j.Str("backend", c.backend);
    j.Str("transport", c.Transport());
    j.Str("control_plane", plane);
    j.Str("direction", direction);
    j.Str("checksum", c.checksum == pdlib::KvChecksum::kAll       ? "all"
                      : c.checksum == pdlib::KvChecksum::kSampled ? "sampled"
                                                                  : "off");
    j.Int("layers", c.layers);
    j.Int("item_bytes", c.item_bytes);
    j.Int("pages", c.pages);
    if (c.decode_prefix) {
      j.Num("decode_prefix", *c.decode_prefix, 6);
    } else {
      j.Null("decode_prefix");
    }
    j.Int("decode_prefix_len", c.PrefixPages() * c.page_size);
    j.Int("pages_sent", c.SentPages());
    j.Str("layout", LayoutName(c.layout));
    j.Int("prefill_tp", uint64_t(c.prefill_tp));
    j.Int("decode_tp", uint64_t(c.decode_tp));
    j.Str("kv_layout", c.kv_layout == pdlib::KVLayout::kNHD ? "nhd" : "hnd");
    j.Int("pool_bytes", c.PoolPages() * c.item_bytes * 2 * c.layers);
    j.Str("pool_alloc", c.pool_alloc == PoolAlloc::kMalloc ? "malloc" : "backend");
    j.Str("pool_memory", pool);
    j.Str("memory", c.memory == pdlib::MemoryKind::kCuda ? "cuda" : "host");
    if (c.memory == pdlib::MemoryKind::kCuda) j.Int("cuda_device", uint64_t(c.cuda_device));
    j.Int("requests", c.requests);
    j.Int("warmup", c.warmup);
    j.Int("concurrency", c.concurrency);
    j.Num("seconds", seconds, 4);
    j.Num("decode_cpu_s", Num(d, "cpu"), 4);
    j.Num("gbps", gbps, 3);
    j.Num("gbytes_per_s", gbps / 8, 3);
    if (cmp.baseline) j.Str("baseline", cmp.baseline->kind);
    if (baseline_gbps) {
      j.Num("baseline_gbps", *baseline_gbps, 3);
      j.Num("baseline_gbytes_per_s", *baseline_gbps / 8, 3);
      j.Num("ratio", gbps / *baseline_gbps, 3);
    } else if (cmp.baseline) {
      j.Null("baseline_gbps");
      j.Null("baseline_gbytes_per_s");
      j.Null("ratio");
    }
    if (cmp.perftest_asked) {
      j.Int("perftest_message_bytes", cmp.perftest_message_bytes);
      if (cmp.perftest_gbytes_per_s) {
        j.Num("perftest_gbytes_per_s", *cmp.perftest_gbytes_per_s, 3);
      } else {
        j.Null("perftest_gbytes_per_s");
      }
    }
    if (cmp.iperf3_asked) {
      if (cmp.iperf3_gbps && *cmp.iperf3_gbps > 0) {
        j.Num("iperf3_gbps", *cmp.iperf3_gbps, 3);
        j.Num("iperf3_ratio", gbps / *cmp.iperf3_gbps, 3);
      } else {
        j.Null("iperf3_gbps");
        j.Null("iperf3_ratio");
      }
    }
    if (g_cluster != nullptr) {
      j.Int("rails", uint64_t(c.rails));
      j.Int("rail_mbit", uint64_t(c.rail_mbit));
      const auto devices = c.backend_options.find("ucx.net_devices");
      if (devices != c.backend_options.end()) j.Str("net_devices", devices->second);
      if (!c.rail_rx_bytes.empty()) j.Ints("rail_rx_bytes", c.rail_rx_bytes);
      if (c.fault) {
        j.Int("fault_rail", uint64_t(c.fault->rail));
        j.Num("fault_at_ms", c.fault->fault_at_ms, 0);
        j.Num("fault_heal_at_ms", c.fault->heal_at_ms, 0);
        j.Num("fault_before_gbps", c.fault->before_gbps, 3);
        j.Num("fault_during_gbps", c.fault->during_gbps, 3);
        j.Num("fault_after_gbps", c.fault->after_gbps, 3);
        if (c.fault->recovery_ms >= 0) {
          j.Num("fault_recovery_ms", c.fault->recovery_ms, 0);
        } else {
          j.Null("fault_recovery_ms");
        }
        if (!c.fault->error.empty()) j.Str("fault_error", c.fault->error);
      }
    }
    if (vs_rails) {
      j.Int("rails_base", uint64_t(vs_rails->rails));
      j.Num("rails_base_gbps", vs_rails->gbps, 3);
      j.Num("rails_gbps_ratio", gbps / vs_rails->gbps, 3);
    }
    j.Int("kv_bytes_per_request", kv_bytes);
    j.Num("moved_bytes_per_request", moved_bytes, 0);
    j.Num("batches_per_request", batches_per_request, 2);
    j.Num("us_per_request", us_per_request, 1);
    if (ref) {
      j.Int("prefix0_kv_bytes_per_request", ref->kv_bytes_per_request);
      j.Num("prefix0_us_per_request", ref->us_per_request, 1);
      j.Num("prefix0_mean_us", ref->mean_us, 1);
      j.Num("bytes_ratio", double(kv_bytes) / double(ref->kv_bytes_per_request), 4);
      j.Num("time_ratio", us_per_request / ref->us_per_request, 4);
      j.Num("mean_us_ratio", Num(d, "mean") / ref->mean_us, 4);
    }
    if (vs_push) {
      j.Num("push_gbps", vs_push->gbps, 3);
      j.Num("push_us_per_request", vs_push->us_per_request, 1);
      j.Num("push_mean_us", vs_push->mean_us, 1);
      j.Num("push_batches_per_request", vs_push->batches_per_request, 2);
      j.Num("pull_push_gbps_ratio", gbps / vs_push->gbps, 4);
      j.Num("pull_push_time_ratio", us_per_request / vs_push->us_per_request, 4);
      j.Num("pull_push_mean_us_ratio", Num(d, "mean") / vs_push->mean_us, 4);
    }
    j.Num("req_per_s", req_per_s, 0);
    j.Num("p50_us", Num(d, "p50"), 0);
    j.Num("p99_us", Num(d, "p99"), 0);
    j.Num("p999_us", Num(d, "p999"), 0);
    j.Num("mean_us", Num(d, "mean"), 1);
    j.Num("max_us", Num(d, "max"), 0);
    j.Num("succeeded", ok, 0);
    j.Num("failed", Num(d, "failed"), 0);
    j.Num("wrong_bytes", Num(d, "wrong"), 0);
    if (Num(d, "failed") > 0 && !error && d.count("why")) {
      j.Str("first_failure", d.at("why"));
    } else {
      j.Null("first_failure");
    }
    j.Num("prefill_write_batches", Num(p, "batches"), 0);
    j.Num("decode_read_batches", pull ? Num(d, "batches") : 0.0, 0);
    if (c.layer_compute_us > 0) {
      j.Int("layer_compute_us", c.layer_compute_us);
      j.Str("layerwise", c.layerwise ? "on" : "off");
      j.Num("exposed_mean_us", Num(d, "exposed_mean"), 1);
      j.Num("exposed_p50_us", Num(d, "exposed_p50"), 0);
      j.Num("exposed_p99_us", Num(d, "exposed_p99"), 0);
    }
    if (failed) {
      j.Str("error", why);
    } else {
      j.Null("error");
    }
    Emit(j.Close());
  } else {
    if (first_row) {
      Emit(
          "backend    transport  plane       dir  layers item_bytes pages prefix  sent layout    "
          " requests  conc   seconds  KV_bytes/req    Gbit/s    req/s    us/req  p50_us  p99_us"
          " failed  baseline_Gbit/s  ratio");
    }
    char prefix[16] = "-";  // no --decode-prefix: the calls without a prefix
    if (c.decode_prefix) std::snprintf(prefix, sizeof(prefix), "%.3g", *c.decode_prefix);
    char buf[512];
    std::snprintf(
        buf, sizeof(buf),
        "%-10s %-10s %-11s %-4s %6" PRIu64 " %10" PRIu64 " %5" PRIu64 " %6s %5" PRIu64
        " %-10s %8" PRIu64 " %5" PRIu64 " %9.3f %13" PRIu64 " %9.3f %8.0f %9.1f %7.0f %7.0f %6.0f",
        c.backend.c_str(), c.Transport().c_str(), plane.c_str(), direction.c_str(), c.layers,
        c.item_bytes, c.pages, prefix, c.SentPages(), std::string(LayoutName(c.layout)).c_str(),
        c.requests, c.concurrency, seconds, kv_bytes, gbps, req_per_s, us_per_request,
        Num(d, "p50"), Num(d, "p99"), Num(d, "failed"));
    std::string row = buf;
    if (c.checksum != pdlib::KvChecksum::kOff) {
      row += c.checksum == pdlib::KvChecksum::kAll ? "  checksum all" : "  checksum sampled";
    }
    if (baseline_gbps) {
      std::snprintf(buf, sizeof(buf), " %16.3f %6.3f", *baseline_gbps, gbps / *baseline_gbps);
      row += buf;
    }
    if (c.layer_compute_us > 0) {
      std::snprintf(buf, sizeof(buf),
                    "  layer_compute_us %" PRIu64
                    " layerwise %-3s exposed_us mean %.1f p50 %.0f p99 %.0f",
                    c.layer_compute_us, c.layerwise ? "on" : "off", Num(d, "exposed_mean"),
                    Num(d, "exposed_p50"), Num(d, "exposed_p99"));
      row += buf;
    }
    Emit(row);
    if (baseline_gbps) {
      std::snprintf(buf, sizeof(buf),
                    "  baseline: %s of the same writes, %.3f GB/s; pdlib / baseline = %.3f "
                    "(pools in %s memory)",
                    cmp.baseline->kind.c_str(), *baseline_gbps / 8, gbps / *baseline_gbps,
                    c.memory == pdlib::MemoryKind::kCuda ? "GPU" : "host");
      Emit(buf);
    }
    if (ref) {
      std::snprintf(buf, sizeof(buf),
                    "  decode prefix %.3g (%" PRIu64 " of %" PRIu64
                    " pages held) vs prefix 0 (this run): KV bytes/request %" PRIu64 " / %" PRIu64
                    " = %.4f; us/request %.1f / %.1f = %.4f; mean latency %.1f / %.1f us = %.4f",
                    *c.decode_prefix, c.PrefixPages(), c.pages, kv_bytes, ref->kv_bytes_per_request,
                    double(kv_bytes) / double(ref->kv_bytes_per_request), us_per_request,
                    ref->us_per_request, us_per_request / ref->us_per_request, Num(d, "mean"),
                    ref->mean_us, Num(d, "mean") / ref->mean_us);
      Emit(buf);
    }
    if (vs_push) {
      std::snprintf(buf, sizeof(buf),
                    "  pull vs push (this run): Gbit/s %.3f / %.3f = %.4f; us/request %.1f / "
                    "%.1f = %.4f; mean latency %.1f / %.1f us = %.4f; batches/request %.2f / %.2f",
                    gbps, vs_push->gbps, gbps / vs_push->gbps, us_per_request,
                    vs_push->us_per_request, us_per_request / vs_push->us_per_request,
                    Num(d, "mean"), vs_push->mean_us, Num(d, "mean") / vs_push->mean_us,
                    batches_per_request, vs_push->batches_per_request);
      Emit(buf);
    }
    if (g_cluster != nullptr && (o.rails.size() > 1 || c.rails > 1 || c.rail_mbit > 0)) {
      auto devices = c.backend_options.find("ucx.rails");
      const bool striped = devices != c.backend_options.end();
      if (!striped) devices = c.backend_options.find("ucx.net_devices");
      std::snprintf(buf, sizeof(buf), "  rails: %d (%s%s), each capped at %s", c.rails,
                    devices != c.backend_options.end() ? devices->second.c_str() : "-",
                    striped ? ", pdlib striping" : "",
                    c.rail_mbit > 0 ? (std::to_string(c.rail_mbit) + " Mbit/s").c_str() : "no cap");
      std::string line = buf;
      if (!c.rail_rx_bytes.empty()) {
        line += "; decode received";
        for (size_t rail = 0; rail < c.rail_rx_bytes.size(); ++rail) {
          std::snprintf(buf, sizeof(buf), "%s %s %.1f MB", rail == 0 ? "" : ",",
                        pdlib_tools::RailInterface(int(rail)).c_str(),
                        double(c.rail_rx_bytes[rail]) / 1e6);
          line += buf;
        }
      }
      Emit(line);
    }
    if (c.fault) {
      const BenchConfig::FaultFigures& f = *c.fault;
      std::snprintf(buf, sizeof(buf),
                    "  rail fault: %s partitioned at %.0f ms for %.0f ms (after decode was "
                    "ready): Gbit/s %.3f in the 2 s before, %.3f during, %.3f in the 2 s after; "
                    "back to 90%% of before %s",
                    pdlib_tools::RailInterface(f.rail).c_str(), f.fault_at_ms,
                    f.heal_at_ms - f.fault_at_ms, f.before_gbps, f.during_gbps, f.after_gbps,
                    f.recovery_ms >= 0
                        ? (std::to_string(int(f.recovery_ms)) + " ms after the heal").c_str()
                        : "not within the run");
      Emit(buf);
      std::string line = "  received Gbit/s per 100 ms:";
      for (const auto& [t, rate] : f.timeline) {
        std::snprintf(buf, sizeof(buf), " %.0f:%.2f", t, rate);
        line += buf;
      }
      Emit(line);
      if (!f.error.empty()) Emit("  rail fault error: " + f.error);
    }
    if (vs_rails) {
      std::snprintf(buf, sizeof(buf), "  %d rails vs %d (this run): Gbit/s %.3f / %.3f = %.3f",
                    c.rails, vs_rails->rails, gbps, vs_rails->gbps, gbps / vs_rails->gbps);
      Emit(buf);
    }
    if (cmp.perftest_gbytes_per_s) {
      std::snprintf(buf, sizeof(buf), "  ucx_perftest ucp_put_bw, %" PRIu64 " B puts: %.3f GB/s",
                    cmp.perftest_message_bytes, *cmp.perftest_gbytes_per_s);
      Emit(buf);
    }
    if (cmp.iperf3_gbps) {
      std::snprintf(buf, sizeof(buf),
                    "  iperf3, one TCP stream %s: %.3f Gbit/s; pdlib / iperf3 = %.3f",
                    g_cluster != nullptr ? "between the two hosts" : "on 127.0.0.1",
                    *cmp.iperf3_gbps, *cmp.iperf3_gbps > 0 ? gbps / *cmp.iperf3_gbps : 0.0);
      Emit(buf);
    }
  }
  if (failed) {
    std::fprintf(stderr, "pdlib-transfer-bench: %s: %s\n", error ? "error" : "first failure",
                 why.c_str());
  }
  return !failed;
}

// --netns: the bytes decode's host has received on each of the cluster's rails so far (its
// eth<r> counters); empty when one cannot be read.
std::vector<uint64_t> DecodeRailRxBytes() {
  std::vector<uint64_t> bytes;
  for (int rail = 0; rail < g_cluster->rails(); ++rail) {
    auto r = g_cluster->Exec(
        "decode",
        {"cat", "/sys/class/net/" + pdlib_tools::RailInterface(rail) + "/statistics/rx_bytes"},
        std::chrono::milliseconds(10000));
    uint64_t value = 0;
    if (!r.ok() || r->exit_status != 0) return {};
    const std::string text = r->output.substr(0, r->output.find('\n'));
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) return {};
    bytes.push_back(value);
  }
  return bytes;
}

// --netns: the backend options of a configuration that uses `rails` rails: UCX over tcp on eth0
// alone for one rail, else pdlib's own striping over eth0 ... eth<rails-1> (ucx.rails: a worker
// and an endpoint per rail). UCX 1.13's own multi-rail (ucx.net_devices=eth0,eth1) left every
// byte of pdlib's active messages on the first rail in this topology (backends/ucx/README.md,
// "Rails"). What the user set with --backend-option stays.
void SetRailOptions(const Options& o, const std::map<std::string, std::string>& user, int rails,
                    BenchConfig* c) {
  c->rails = rails;
  c->rail_mbit = o.rail_mbit;
  if (c->backend != "ucx") return;
  std::string devices;
  for (int rail = 0; rail < rails; ++rail) {
    devices += (rail == 0 ? "" : ",") + pdlib_tools::RailInterface(rail);
  }
  if (user.count("ucx.rails") || user.count("ucx.net_devices")) return;
  c->backend_options.erase("ucx.net_devices");
  c->backend_options.erase("ucx.rails");
  c->backend_options[rails == 1 ? "ucx.net_devices" : "ucx.rails"] = devices;
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
  if (o.base.verify && (o.base.prefill_tp != 1 || o.base.decode_tp != 1)) {
    std::fprintf(stderr,
                 "pdlib-transfer-bench: --verify checks 1:1 pages; use ctest -R tp for M:N "
                 "byte checks\n");
    return 2;
  }
  if (o.base.verify && (o.concurrency.size() != 1 || o.concurrency[0] != 1)) {
    std::fprintf(stderr, "pdlib-transfer-bench: --verify needs --concurrency 1\n");
    return 2;
  }
  if (o.base.memory == pdlib::MemoryKind::kCuda) {
    if (std::string why = CudaUsable(o.base.cuda_device); !why.empty()) {
      std::fprintf(stderr, "pdlib-transfer-bench: --memory cuda: no CUDA device: %s\n",
                   why.c_str());
      return 2;
    }
  }
  if (!o.role.empty()) {
    // A child runs exactly one configuration: the first of each list.
    o.base.concurrency = o.concurrency.front();
    o.base.pages = o.pages.front();
    o.base.layers = o.layers.front();
    o.base.item_bytes = o.item_bytes.front();
    o.base.layout = o.layouts.front();
    o.base.layerwise = o.layerwise.front();
    o.base.decode_prefix = o.decode_prefixes.front();
    o.base.direction = o.directions.front();
    return RunChild(o);
  }

  // What the command line set, before --netns adds its own (SetRailOptions keeps the user's).
  const std::map<std::string, std::string> user_options = o.base.backend_options;
  std::unique_ptr<pdlib_tools::NetnsCluster> cluster;
  if (o.netns) {
    const int max_rails = *std::max_element(o.rails.begin(), o.rails.end());
    auto c = pdlib_tools::NetnsCluster::Create({.rails = max_rails});
    if (!c.ok()) {
      // This machine cannot build the hosts (no root, no `ip netns`): a test skips on it.
      std::fprintf(stderr, "pdlib-transfer-bench: SKIP: --netns: %s\n",
                   c.status().ToString().c_str());
      return kCannotRunHere;
    }
    cluster = std::move(*c);
    for (const char* host : {"prefill", "decode"}) {
      auto ip = cluster->AddHost(host);
      if (!ip.ok()) {
        std::fprintf(stderr, "pdlib-transfer-bench: --netns: %s\n", ip.status().ToString().c_str());
        return 2;
      }
    }
    if (o.rail_mbit > 0) {
      for (const char* host : {"prefill", "decode"}) {
        for (int rail = 0; rail < max_rails; ++rail) {
          if (pdlib::Status s = cluster->SetRailBandwidth(host, rail, o.rail_mbit); !s.ok()) {
            std::fprintf(stderr, "pdlib-transfer-bench: --rail-mbit: %s\n", s.ToString().c_str());
            return 2;
          }
        }
      }
    }
    g_cluster = cluster.get();
    o.base.prefill_host = cluster->FindHost("prefill")->ip;
    if (o.base.backend == "ucx") {  // two hosts: TCP over their link, nothing shared
      o.base.backend_options["ucx.tls"] = "tcp";
      o.base.backend_options["ucx.net_devices"] = "eth0";
    }
  }
  bool all_ok = true, first = true;
  std::map<bool, double> exposed;  // mean exposed transfer by layerwise, per configuration
  for (uint64_t layers : o.layers) {
    for (uint64_t item : o.item_bytes) {
      for (uint64_t pages : o.pages) {
        for (Layout layout : o.layouts) {
          for (uint64_t conc : o.concurrency) {
            // Per (direction, decode prefix, layerwise): the first rail count's Gbit/s, which
            // the rows with the other rail counts are compared with.
            std::map<std::tuple<pdlib::TransferDirection, std::optional<double>, bool>, RailsBase>
                first_rails;
            for (int rails : o.rails) {
              // Per (decode prefix, layerwise) of this shape: the push row's figures, which the
              // pull row is compared with, and the comparisons (baseline, perftest, iperf3), run
              // once and shown on both rows.
              std::map<std::pair<std::optional<double>, bool>, RowFigures> push_rows;
              std::map<std::pair<std::optional<double>, bool>, Comparisons> compared;
              for (pdlib::TransferDirection direction : o.directions) {
                // The prefix-0 rows of this shape come first (ParseArgs), one per layerwise; the
                // rows with a prefix are compared with them.
                std::map<bool, RowFigures> prefix0;
                for (const std::optional<double>& decode_prefix : o.decode_prefixes) {
                  for (bool layerwise : o.layerwise) {
                    // The row without a checksum (first) that the rows with one are compared with.
                    std::optional<RowFigures> checksum_off;
                    for (pdlib::KvChecksum checksum : o.checksums) {
                      BenchConfig c = o.base;
                      c.checksum = checksum;
                      if (g_cluster != nullptr) SetRailOptions(o, user_options, rails, &c);
                      c.direction = direction;
                      c.decode_prefix = decode_prefix;
                      c.layerwise = layerwise;
                      c.layers = layers;
                      c.item_bytes = item;
                      c.pages = pages;
                      c.layout = layout;
                      c.concurrency = conc;
                      std::map<std::string, std::string> prefill;
                      const std::vector<uint64_t> rx_before =
                          g_cluster != nullptr ? DecodeRailRxBytes() : std::vector<uint64_t>{};
                      const Options::RailFault* fault = g_cluster != nullptr &&
                                                                o.rail_fault.rail >= 0 &&
                                                                c.rails > o.rail_fault.rail
                                                            ? &o.rail_fault
                                                            : nullptr;
                      auto decode = o.in_process
                                        ? RunInProcess(c, &prefill)
                                        : RunTwoProcesses(&c, &prefill, fault, o.stall_timeout_s);
                      if (g_cluster != nullptr) {
                        const std::vector<uint64_t> rx_after = DecodeRailRxBytes();
                        if (!rx_before.empty() && rx_after.size() == rx_before.size()) {
                          for (size_t i = 0; i < rx_after.size(); ++i) {
                            c.rail_rx_bytes.push_back(rx_after[i] - rx_before[i]);
                          }
                        }
                      }
                      const auto key = std::make_pair(decode_prefix, layerwise);
                      if (!compared.count(key)) compared[key] = Compare(o, c);
                      std::optional<RowFigures> reference, push;
                      if (c.PrefixPages() > 0 && prefix0.count(layerwise)) {
                        reference = prefix0[layerwise];
                      }
                      if (direction == pdlib::TransferDirection::kPull && push_rows.count(key)) {
                        push = push_rows[key];
                      }
                      const auto rails_key = std::make_tuple(direction, decode_prefix, layerwise);
                      std::optional<RailsBase> rails_base;
                      if (rails != o.rails.front() && first_rails.count(rails_key)) {
                        rails_base = first_rails[rails_key];
                      }
                      RowFigures figures;
                      const bool off = checksum == pdlib::KvChecksum::kOff;
                      if (!off) reference.reset(), push.reset(), rails_base.reset();
                      const bool ok = Report(o, c, decode, prefill, compared[key], first, reference,
                                             push, rails_base, &figures);
                      if (ok && rails == o.rails.front() && off) {
                        first_rails[rails_key] = {rails, figures.gbps};
                      }
                      all_ok &= ok;
                      first = false;
                      if (off && decode_prefix && *decode_prefix == 0 && ok) {
                        prefix0[layerwise] = figures;
                      }
                      if (off && direction == pdlib::TransferDirection::kPush && ok) {
                        push_rows[key] = figures;
                      }
                      if (off && ok) checksum_off = figures;
                      if (!off && ok && checksum_off && checksum_off->us_per_request > 0 &&
                          checksum_off->mean_us > 0) {
                        std::fprintf(
                            o.json ? stderr : stdout,
                            "  checksum %s vs off (this run): us/request %.1f / %.1f = %.4f; mean "
                            "latency %.1f / %.1f us = %.4f; Gbit/s %.3f / %.3f\n",
                            checksum == pdlib::KvChecksum::kAll ? "all" : "sampled",
                            figures.us_per_request, checksum_off->us_per_request,
                            figures.us_per_request / checksum_off->us_per_request, figures.mean_us,
                            checksum_off->mean_us, figures.mean_us / checksum_off->mean_us,
                            figures.gbps, checksum_off->gbps);
                      }
                      if (c.layer_compute_us > 0) {
                        exposed[layerwise] = Num(decode, "exposed_mean");
                        if (exposed.size() == 2 && exposed[false] > 0) {
                          std::fprintf(
                              o.json ? stderr : stdout,
                              "  exposed transfer with streaming / without: %.1f / %.1f us "
                              "= 1/%.1f\n",
                              exposed[true], exposed[false],
                              exposed[true] > 0 ? exposed[false] / exposed[true] : 0.0);
                          exposed.clear();
                        }
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return all_ok ? 0 : 1;
}
