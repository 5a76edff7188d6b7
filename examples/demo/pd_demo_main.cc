// pd-demo: the example deployment end to end, run by `make demo`.
//
// Starts on 127.0.0.1 a pdlib-bootstrap, a pd-prefill, a pd-decode, a colocated pd-decode and
// pd-router (the small example model, pdlib over UCX by default), sends a batch of prompts
// through the router, prints a line per request, sends the same prompts to the colocated host
// (prefill and decode on one engine, no transfer), and ends with
//   N/N outputs identical to the colocated run
// or names the requests that differ or failed and exits 1. --rates runs the batch at several
// request rates and prints tokens/s and TTFT of both for each.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "examples/demo/deployment.h"

namespace {

using pdlib::demo::Deployment;
using pdlib::demo::DeploymentOptions;
using pdlib::demo::Outcome;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: pd-demo [options]\n"
    "\n"
    "Runs bootstrap, prefill, decode, a colocated host and the router on 127.0.0.1, sends a\n"
    "batch of prompts through the router and checks every output against the colocated run.\n"
    "\n"
    "  --requests N          prompts in the batch (default 16)\n"
    "  --max-new-tokens N    tokens generated per request (default 16)\n"
    "  --rates R[,R...]      request rates in requests/s to run the batch at; 0 sends the whole\n"
    "                        batch at once (default 0)\n"
    "  --model M             small | small-hybrid (default small)\n"
    "  --seed N              model weights and prompts (default 1)\n"
    "  --backend B           pdlib backend of the hosts: ucx | fake | verbs (default ucx)\n"
    "  --backend-option K=V  passed to every host (repeatable)\n"
    "  --prefills N          prefill hosts (default 1)     --decodes N   decode hosts (default 1)\n"
    "  --prefill-tp N        TP ranks per prefill host      --prefill-pp N  PP stages (default 1)\n"
    "  --policy P            router policy: random | power-of-two | least-loaded\n"
    "  --log-dir DIR         where each process's log goes (default: a new /tmp/pd-demo-* dir)\n"
    "  --quiet               no per-request table\n"
    "  --help\n";

struct Args {
  int requests = 16;
  int max_new_tokens = 16;
  std::vector<double> rates = {0};
  bool quiet = false;
  DeploymentOptions d;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "pd-demo: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&](const char* name, long lo, long hi) {
      const char* v = value(name);
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (*v == '\0' || *end != '\0' || n < lo || n > hi) {
        std::fprintf(stderr, "pd-demo: %s '%s' is not a number in [%ld, %ld]\n", name, v, lo, hi);
        std::exit(2);
      }
      return n;
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--requests") {
      a->requests = int(number("--requests", 1, 4096));
    } else if (arg == "--max-new-tokens") {
      a->max_new_tokens = int(number("--max-new-tokens", 1, 1024));
    } else if (arg == "--rates") {
      a->rates.clear();
      std::string list = value("--rates");
      for (size_t at = 0; at <= list.size();) {
        size_t comma = std::min(list.find(',', at), list.size());
        const std::string item = list.substr(at, comma - at);
        char* end = nullptr;
        const double r = std::strtod(item.c_str(), &end);
        if (item.empty() || *end != '\0' || r < 0) {
          std::fprintf(stderr, "pd-demo: --rates '%s': '%s' is not a rate >= 0\n", list.c_str(),
                       item.c_str());
          return false;
        }
        a->rates.push_back(r);
        at = comma + 1;
      }
    } else if (arg == "--model") {
      a->d.model = value("--model");
    } else if (arg == "--seed") {
      a->d.seed = uint64_t(number("--seed", 0, INT32_MAX));
    } else if (arg == "--backend") {
      a->d.backend = value("--backend");
    } else if (arg == "--backend-option") {
      a->d.backend_options.push_back(value("--backend-option"));
    } else if (arg == "--prefills") {
      a->d.prefills.resize(size_t(number("--prefills", 1, 16)), a->d.prefills[0]);
    } else if (arg == "--decodes") {
      a->d.decodes = int32_t(number("--decodes", 1, 16));
    } else if (arg == "--prefill-tp") {
      const int32_t tp = int32_t(number("--prefill-tp", 1, 8));
      for (auto& p : a->d.prefills) p.tp = tp;
    } else if (arg == "--prefill-pp") {
      const int32_t pp = int32_t(number("--prefill-pp", 1, 4));
      for (auto& p : a->d.prefills) p.pp = pp;
    } else if (arg == "--policy") {
      a->d.policy = value("--policy");
    } else if (arg == "--log-dir") {
      a->d.log_dir = value("--log-dir");
    } else if (arg == "--quiet") {
      a->quiet = true;
    } else {
      std::fprintf(stderr, "pd-demo: unknown argument '%s'\n%s", arg.c_str(), kUsage);
      return false;
    }
  }
  return true;
}

// Prompts of varied lengths (8 to 300 tokens), the same for a given seed.
std::vector<std::vector<int32_t>> MakePrompts(int n, uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 17);
  const int lengths[] = {24, 300, 8, 120, 57, 200, 16, 96, 150, 33, 250, 64, 180, 12, 75, 128};
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p(size_t(lengths[i % 16] + i / 16));
    for (auto& t : p) t = int32_t(rng() % 512);
    prompts.push_back(std::move(p));
  }
  return prompts;
}

struct RunStats {
  double seconds = 0;
  uint64_t tokens = 0;
  std::vector<int64_t> ttft_us;
};

// Sends every prompt (at `rate` requests/s, or all at once) through `send` on its own thread.
std::vector<Outcome> RunBatch(const std::vector<std::vector<int32_t>>& prompts, double rate,
                              const std::function<Outcome(const std::vector<int32_t>&)>& send,
                              RunStats* stats) {
  std::vector<Outcome> out(prompts.size());
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (rate > 0) {
      std::this_thread::sleep_until(start + std::chrono::microseconds(int64_t(1e6 * i / rate)));
    }
    threads.emplace_back([&, i] { out[i] = send(prompts[i]); });
  }
  for (auto& t : threads) t.join();
  stats->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (const Outcome& o : out) {
    stats->tokens += o.output_ids.size();
    if (o.ok) stats->ttft_us.push_back(o.ttft_us);
  }
  std::sort(stats->ttft_us.begin(), stats->ttft_us.end());
  return out;
}

double Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  return double(sorted[std::min(sorted.size() - 1, size_t(p * double(sorted.size())))]) / 1000.0;
}

void PrintSummary(const char* what, double rate, const RunStats& s) {
  double mean = 0;
  for (int64_t t : s.ttft_us) mean += double(t) / 1000.0;
  if (!s.ttft_us.empty()) mean /= double(s.ttft_us.size());
  std::printf(
      "%-13s rate %-6s %4zu ok  %6.1f tokens/s  TTFT mean %7.1f ms  p50 %7.1f ms  "
      "p90 %7.1f ms  (%.2f s)\n",
      what, rate > 0 ? std::to_string(int(rate)).c_str() : "burst", s.ttft_us.size(),
      double(s.tokens) / s.seconds, mean, Percentile(s.ttft_us, 0.5), Percentile(s.ttft_us, 0.9),
      s.seconds);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.d.prefill_bin = PD_DEMO_PREFILL_BIN;
  a.d.decode_bin = PD_DEMO_DECODE_BIN;
  a.d.router_bin = PD_DEMO_ROUTER_BIN;
  a.d.bootstrap_bin = PD_DEMO_BOOTSTRAP_BIN;
  if (!ParseArgs(argc, argv, &a)) return 2;
  if (a.d.log_dir.empty()) {
    char tmpl[] = "/tmp/pd-demo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      std::perror("pd-demo: mkdtemp");
      return 1;
    }
    a.d.log_dir = tmpl;
  }
  std::filesystem::create_directories(a.d.log_dir);
  std::printf(
      "pd-demo: starting bootstrap, %zu prefill (tp %d, pp %d), %d decode, colocated and "
      "router on 127.0.0.1 (backend %s, model %s); logs in %s\n",
      a.d.prefills.size(), a.d.prefills[0].tp, a.d.prefills[0].pp, a.d.decodes, a.d.backend.c_str(),
      a.d.model.c_str(), a.d.log_dir.c_str());
  std::fflush(stdout);
  const auto t0 = Clock::now();
  auto dep = Deployment::Start(a.d);
  if (!dep.ok()) {
    std::fprintf(stderr, "pd-demo: %s\n", dep.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "pd-demo: ready in %.1f s; router at %s (HTTP: curl -s 127.0.0.1:%d/v1/completions "
      "-d '{\"prompt\":\"hello\",\"max_tokens\":8}')\n",
      std::chrono::duration<double>(Clock::now() - t0).count(), (*dep)->router_address().c_str(),
      (*dep)->http_port());
  const auto prompts = MakePrompts(a.requests, a.d.seed);
  int differ = 0, failed = 0;
  for (double rate : a.rates) {
    RunStats ds, cs;
    auto disagg = RunBatch(
        prompts, rate,
        [&](const std::vector<int32_t>& p) { return (*dep)->Generate(p, a.max_new_tokens); }, &ds);
    auto coloc = RunBatch(
        prompts, rate,
        [&](const std::vector<int32_t>& p) {
          return (*dep)->GenerateColocated(p, a.max_new_tokens);
        },
        &cs);
    if (!a.quiet) {
      std::printf("\n%4s %6s %4s %9s %11s %9s %12s  %s\n", "req", "prompt", "out", "ttft_ms",
                  "transfer_ms", "kv_bytes", "coloc_ttft", "output");
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      const Outcome& d = disagg[i];
      const Outcome& c = coloc[i];
      const bool same = d.ok && c.ok && d.output_ids == c.output_ids &&
                        int(d.output_ids.size()) == a.max_new_tokens;
      if (!d.ok || !c.ok)
        ++failed;
      else if (!same)
        ++differ;
      if (!a.quiet || !same) {
        std::printf("%4zu %6zu %4zu %9.1f %11.2f %9llu %12.1f  %s\n", i, prompts[i].size(),
                    d.output_ids.size(), double(d.ttft_us) / 1000, double(d.transfer_us) / 1000,
                    static_cast<unsigned long long>(d.kv_bytes), double(c.ttft_us) / 1000,
                    same    ? "identical"
                    : !d.ok ? ("FAILED: " + d.reason).c_str()
                    : !c.ok ? ("colocated FAILED: " + c.reason).c_str()
                            : "DIFFERS from the colocated run");
      }
    }
    std::printf("\n");
    PrintSummary("disaggregated", rate, ds);
    PrintSummary("colocated", rate, cs);
  }
  const int total = a.requests * int(a.rates.size());
  const int identical = total - differ - failed;
  std::printf("\n%d/%d outputs identical to the colocated run", identical, total);
  if (differ + failed > 0) std::printf(" (%d differ, %d failed)", differ, failed);
  std::printf("\n");
  std::fflush(stdout);
  if (differ + failed > 0) std::fprintf(stderr, "%s", (*dep)->LogTails().c_str());
  return differ + failed == 0 ? 0 : 1;
}
