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

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "examples/demo/deployment.h"
#include "pdlib_kernels/cuda_info.h"
#include "tools/common/flags.h"

ABSL_FLAG(int64_t, requests, 16, "prompts in the batch");
ABSL_FLAG(int64_t, max_new_tokens, 16, "tokens generated per request");
ABSL_FLAG(std::string, rates, "0",
          "request rates in requests/s to run the batch at, comma-separated; 0 sends the whole "
          "batch at once");
ABSL_FLAG(std::string, model, "small",
          "small | small-hybrid (mamba state) | small-mla (multi-head latent attention) | "
          "small-swa (sliding-window layers: SWA state) | small-nsa (a lightning indexer picks the "
          "positions each token attends to: NSA state)");
ABSL_FLAG(int64_t, seed, 1, "model weights and prompts");
ABSL_FLAG(std::string, backend, "",
          "pdlib backend of the hosts: ucx | fake | verbs | cuda_ipc; default ucx, cuda_ipc with "
          "--device cuda");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda: where the prefill and decode hosts run the model and keep their KV pools "
          "(pd-prefill/pd-decode --device; cuda: the CUDA model, KV pools in GPU memory, models "
          "small and small-hybrid). Without a usable GPU pd-demo exits 1 with the reason before "
          "starting anything");
ABSL_FLAG(int64_t, cuda_device, 0, "with --device cuda: the GPU of every host");
ABSL_FLAG(std::string, reference_device, "cpu",
          "cpu | cuda: where the colocated host, the reference every output is compared with, "
          "runs. cpu (the default) checks a --device cuda run token for token against the CPU "
          "model; cuda compares GPU with GPU (the transfer alone), on --cuda-device");
ABSL_FLAG(pdlib_tools::Repeated, backend_option, {}, "K=V passed to every host (repeatable)");
ABSL_FLAG(int64_t, prefills, 1, "prefill hosts");
ABSL_FLAG(int64_t, decodes, 1, "decode hosts");
ABSL_FLAG(int64_t, prefill_tp, 1, "TP ranks per prefill host (any that divides the model)");
ABSL_FLAG(int64_t, prefill_pp, 1, "PP stages per prefill host");
ABSL_FLAG(int64_t, decode_tp, 1,
          "TP ranks per decode host: each holds and receives only its share of the heads, from "
          "whatever prefill TP it is paired with");
ABSL_FLAG(int64_t, decode_pp, 1, "PP stages per decode host: 1 or --prefill-pp");
ABSL_FLAG(std::string, policy, "power-of-two",
          "router policy: random | power-of-two | least-loaded");
ABSL_FLAG(std::string, log_dir, "",
          "where each process's log goes (\"\": a new /tmp/pd-demo-* directory)");
ABSL_FLAG(bool, quiet, false, "no per-request table");
ABSL_FLAG(std::string, layerwise, "on",
          "prefill hosts' layer-wise streaming (pd-prefill --layerwise): on | off | both (the "
          "whole run twice, off then on, each on a fresh deployment, then how much of the TTFT "
          "gap between disaggregated and colocated streaming removed)");

ABSL_FLAG(int64_t, turns, 1,
          "multi-turn conversations: each request is a conversation of N turns, turn t+1's prompt "
          "being turn t's prompt, its output and a few new tokens (sent once every conversation "
          "finished turn t); the colocated run recomputes every prompt");
ABSL_FLAG(std::string, prefix_reuse, "auto",
          "decode prefix reuse (pd-decode --prefix-cache-pages): off | on | both (the whole run "
          "twice, off then on, each on a fresh deployment, then the KV bytes moved and TTFT of "
          "both) | auto (both with --turns > 1, else off). Models without per-request state "
          "(small, small-mla)");

ABSL_FLAG(std::string, direction, "push",
          "which way pdlib moves KV between the prefill and decode hosts (pd-prefill/pd-decode "
          "--direction): push (prefill writes into decode's pages) | pull (prefill publishes "
          "every page of the prompt as it is computed, decode reads the pages after its prefix) "
          "| both (the whole run twice, push then pull, each on a fresh deployment, then TTFT, "
          "transfer time and KV bytes moved of both). pull needs a backend that can read");

ABSL_FLAG(bool, netns, false,
          "every process in a network namespace of its own (a host with its own address on one "
          "bridge; UCX over tcp on eth0 only, no shared memory between hosts). Needs root and "
          "iproute2; see tools/netns");
ABSL_FLAG(int64_t, link_mbit, 0,
          "with --netns: cap every host's link at N Mbit/s each way (tc tbf); 0: no cap");
ABSL_FLAG(std::string, discovery, "bootstrap",
          "how decode finds prefill ranks: bootstrap (a pdlib-bootstrap per prefill host) or etcd "
          "(one etcd member, Debian's etcd-server, that every host registers in and watches)");

namespace {

using pdlib::demo::Deployment;
using pdlib::demo::DeploymentOptions;
using pdlib::demo::Outcome;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: pd-demo [flags]\n"
    "\n"
    "Runs bootstrap, prefill, decode, a colocated host and the router on 127.0.0.1, sends a\n"
    "batch of prompts through the router and checks every output against the colocated run.\n"
    "\n"
    "Layouts: --model picks the example model (GQA, hybrid with mamba state, MLA, sliding\n"
    "window); --prefill-tp/--prefill-pp and --decode-tp/--decode-pp shard each host's model\n"
    "(every rank holds and moves only its heads and layers; decode PP is 1 or the prefill's).\n"
    "The colocated baseline always runs TP 1, PP 1. Each host's model threads are split\n"
    "across its ranks (hardware threads / ranks each).\n"
    "\n"
    "  pd-demo --model small-mla --prefill-tp 2 --decode-tp 1\n"
    "  pd-demo --prefill-tp 2 --prefill-pp 2 --decode-tp 2 --decode-pp 2\n"
    "\n"
    "Layer-wise streaming (on by default): prefill hands each layer's KV to pdlib as the model\n"
    "finishes it, so the transfer runs during the forward pass. The table's exposed_ms is the\n"
    "transfer time left after a request's last forward pass (prefill's measure); transfer_ms is\n"
    "decode's wait from KVReceiver::Init to the KV's arrival (prefill's queue and forward\n"
    "included). --layerwise both compares the two modes in one run:\n"
    "  pd-demo --requests 32 --max-new-tokens 32 --rates 20 --layerwise both \\\n"
    "      --backend-option ucx.tls=tcp --backend-option ucx.net_devices=lo\n"
    "Before each measured batch one short warm-up request goes through each path (not counted),\n"
    "and decode hosts connect to the prefill deployments at start (pd-decode --connect).\n"
    "\n"
    "On a GPU: --device cuda runs the prefill and decode hosts' model on the GPU with their KV\n"
    "pools in GPU memory, moved by pdlib over cuda_ipc (the default backend then); the colocated\n"
    "reference stays on the CPU (--reference-device cuda moves it to the GPU), so the check is\n"
    "GPU disaggregated against the CPU model, token for token:\n"
    "  pd-demo --device cuda --requests 16\n"
    "\n"
    "Multi-turn conversations and decode prefix reuse: --turns N makes each request a\n"
    "conversation (the next prompt is the previous prompt, its output and new tokens); with\n"
    "prefix reuse decode keeps finished requests' pages and prefill sends only the new tail.\n"
    "--prefix-reuse both (the default with --turns > 1) runs it off then on and compares:\n"
    "  pd-demo --turns 4 --requests 8 --backend-option ucx.tls=tcp \\\n"
    "      --backend-option ucx.net_devices=lo\n"
    "\n"
    "Push or pull: --direction pull makes decode read prefill's pages (prefill publishes each\n"
    "chunk as soon as it is computed, without waiting for decode, and frees it once every\n"
    "decode rank has read it); --direction both runs push then pull and compares them:\n"
    "  pd-demo --direction both --requests 16\n"
    "  pd-demo --direction pull --turns 3 --prefix-reuse on   # decode reads only its new tail\n"
    "At most one of --layerwise, --prefix-reuse and --direction may be both.\n"
    "\n"
    "Beyond one host (root): --netns puts every process in a network namespace of its own, so\n"
    "UCX goes over TCP between hosts as in a cluster; --link-mbit N caps each link; --discovery\n"
    "etcd replaces the bootstrap servers with one etcd member:\n"
    "  pd-demo --netns --prefills 2 --decodes 2 --discovery etcd\n";

struct Args {
  int requests = 16;
  int max_new_tokens = 16;
  std::vector<double> rates = {0};
  bool quiet = false;
  std::vector<bool> layerwise = {true};  // one phase per entry
  int turns = 1;
  std::vector<bool> prefix_reuse = {false};       // one phase per entry
  std::vector<std::string> direction = {"push"};  // one phase per entry
  DeploymentOptions d;
};

// Decode hosts' prefix cache when prefix reuse is on: half of their KV pages.
constexpr int32_t kPrefixCachePages = 256;

// Reads and checks the flags; prints why (naming the flag) and returns false on bad input.
bool ParseArgs(int argc, char** argv, Args* a) {
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage, {}, {"backend_option"});
  auto in_range = [](const char* name, int64_t v, int64_t lo, int64_t hi) {
    if (v >= lo && v <= hi) return true;
    std::fprintf(stderr, "pd-demo: --%s %lld is not in [%lld, %lld]\n", name,
                 static_cast<long long>(v), static_cast<long long>(lo), static_cast<long long>(hi));
    return false;
  };
  const int64_t requests = absl::GetFlag(FLAGS_requests);
  const int64_t max_new = absl::GetFlag(FLAGS_max_new_tokens);
  const int64_t prefills = absl::GetFlag(FLAGS_prefills), decodes = absl::GetFlag(FLAGS_decodes);
  const int64_t tp = absl::GetFlag(FLAGS_prefill_tp), pp = absl::GetFlag(FLAGS_prefill_pp);
  const int64_t dtp = absl::GetFlag(FLAGS_decode_tp), dpp = absl::GetFlag(FLAGS_decode_pp);
  const int64_t seed = absl::GetFlag(FLAGS_seed);
  const int64_t turns = absl::GetFlag(FLAGS_turns);
  if (!in_range("turns", turns, 1, 64)) return false;
  a->turns = int(turns);
  if (!in_range("requests", requests, 1, 4096) || !in_range("max_new_tokens", max_new, 1, 1024) ||
      !in_range("prefills", prefills, 1, 16) || !in_range("decodes", decodes, 1, 16) ||
      !in_range("prefill_tp", tp, 1, 8) || !in_range("prefill_pp", pp, 1, 4) ||
      !in_range("decode_tp", dtp, 1, 8) || !in_range("decode_pp", dpp, 1, 4) ||
      !in_range("seed", seed, 0, INT32_MAX)) {
    return false;
  }
  a->requests = int(requests);
  a->max_new_tokens = int(max_new);
  a->rates.clear();
  const std::string rates = absl::GetFlag(FLAGS_rates);
  for (absl::string_view item : absl::StrSplit(rates, ',')) {
    double r = 0;
    if (!absl::SimpleAtod(item, &r) || r < 0) {
      std::fprintf(stderr, "pd-demo: --rates '%s': '%s' is not a rate >= 0\n", rates.c_str(),
                   std::string(item).c_str());
      return false;
    }
    a->rates.push_back(r);
  }
  a->d.model = absl::GetFlag(FLAGS_model);
  a->d.seed = uint64_t(seed);
  a->d.device = absl::GetFlag(FLAGS_device);
  a->d.colocated_device = absl::GetFlag(FLAGS_reference_device);
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string&>{"device", a->d.device},
        {"reference_device", a->d.colocated_device}}) {
    if (value != "cpu" && value != "cuda") {
      std::fprintf(stderr, "pd-demo: --%s '%s': expected cpu or cuda\n", flag, value.c_str());
      return false;
    }
  }
  const int64_t cuda_device = absl::GetFlag(FLAGS_cuda_device);
  if (!in_range("cuda_device", cuda_device, 0, 1023)) return false;
  a->d.cuda_device = int32_t(cuda_device);
  a->d.backend = absl::GetFlag(FLAGS_backend);
  // GPU pools need a backend that reaches GPU memory (pd-prefill/pd-decode pick the same).
  if (a->d.backend.empty()) a->d.backend = a->d.device == "cuda" ? "cuda_ipc" : "ucx";
  a->d.backend_options = absl::GetFlag(FLAGS_backend_option).values;
  a->d.prefills.resize(size_t(prefills), a->d.prefills[0]);
  for (auto& p : a->d.prefills) {
    p.tp = int32_t(tp);
    p.pp = int32_t(pp);
  }
  a->d.decodes = int32_t(decodes);
  a->d.decode_tp = int32_t(dtp);
  a->d.decode_pp = int32_t(dpp);
  a->d.policy = absl::GetFlag(FLAGS_policy);
  a->d.log_dir = absl::GetFlag(FLAGS_log_dir);
  a->quiet = absl::GetFlag(FLAGS_quiet);
  a->d.netns = absl::GetFlag(FLAGS_netns);
  a->d.discovery = absl::GetFlag(FLAGS_discovery);
  if (a->d.discovery != "bootstrap" && a->d.discovery != "etcd") {
    std::fprintf(stderr, "pd-demo: --discovery '%s': expected bootstrap or etcd\n",
                 a->d.discovery.c_str());
    return false;
  }
  const int64_t link_mbit = absl::GetFlag(FLAGS_link_mbit);
  if (!in_range("link_mbit", link_mbit, 0, 1000000)) return false;
  if (link_mbit > 0 && !a->d.netns) {
    std::fprintf(stderr, "pd-demo: --link-mbit needs --netns\n");
    return false;
  }
  a->d.link_mbit = int32_t(link_mbit);
  const std::string layerwise = absl::GetFlag(FLAGS_layerwise);
  if (layerwise == "on") {
    a->layerwise = {true};
  } else if (layerwise == "off") {
    a->layerwise = {false};
  } else if (layerwise == "both") {
    a->layerwise = {false, true};
  } else {
    std::fprintf(stderr, "pd-demo: --layerwise '%s': expected on, off or both\n",
                 layerwise.c_str());
    return false;
  }
  const std::string reuse = absl::GetFlag(FLAGS_prefix_reuse);
  if (reuse == "on") {
    a->prefix_reuse = {true};
  } else if (reuse == "off") {
    a->prefix_reuse = {false};
  } else if (reuse == "both" || (reuse == "auto" && a->turns > 1)) {
    a->prefix_reuse = {false, true};
  } else if (reuse == "auto") {
    a->prefix_reuse = {false};
  } else {
    std::fprintf(stderr, "pd-demo: --prefix-reuse '%s': expected off, on, both or auto\n",
                 reuse.c_str());
    return false;
  }
  const std::string direction = absl::GetFlag(FLAGS_direction);
  if (direction == "push" || direction == "pull") {
    a->direction = {direction};
  } else if (direction == "both") {
    a->direction = {"push", "pull"};
  } else {
    std::fprintf(stderr, "pd-demo: --direction '%s': expected push, pull or both\n",
                 direction.c_str());
    return false;
  }
  const int boths =
      int(a->layerwise.size() > 1) + int(a->prefix_reuse.size() > 1) + int(a->direction.size() > 1);
  if (boths > 1) {
    std::fprintf(stderr,
                 "pd-demo: --layerwise both, --prefix-reuse both (or auto with --turns > 1) and "
                 "--direction both each run the batch twice: pick one of them\n");
    return false;
  }
  const bool stateful =
      a->d.model == "small-hybrid" || a->d.model == "small-swa" || a->d.model == "small-nsa";
  if (stateful && a->prefix_reuse.back()) {
    std::fprintf(stderr,
                 "pd-demo: --prefix-reuse: model %s carries per-request state, which the decode "
                 "prefix cache does not hold (use small or small-mla, or --prefix-reuse off)\n",
                 a->d.model.c_str());
    return false;
  }
  return true;
}

// "cpu" or "cuda:N".
std::string DeviceName(const DeploymentOptions& d, const std::string& device) {
  return device == "cuda" ? "cuda:" + std::to_string(d.cuda_device) : device;
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
  std::vector<int64_t> exposed_us;  // disaggregated: prefill's exposed transfer time

  double MeanTtftMs() const { return Mean(ttft_us); }
  double MeanExposedMs() const { return Mean(exposed_us); }
  static double Mean(const std::vector<int64_t>& v) {
    double sum = 0;
    for (int64_t t : v) sum += double(t) / 1000.0;
    return v.empty() ? 0 : sum / double(v.size());
  }
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
    if (o.ok) stats->exposed_us.push_back(o.exposed_transfer_us);
  }
  std::sort(stats->ttft_us.begin(), stats->ttft_us.end());
  return out;
}

double Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  return double(sorted[std::min(sorted.size() - 1, size_t(p * double(sorted.size())))]) / 1000.0;
}

void PrintSummary(const char* what, double rate, const RunStats& s, bool exposed) {
  std::printf(
      "%-13s rate %-6s %4zu ok  %6.1f tokens/s  TTFT mean %7.1f ms  p50 %7.1f ms  "
      "p90 %7.1f ms  (%.2f s)",
      what, rate > 0 ? std::to_string(int(rate)).c_str() : "burst", s.ttft_us.size(),
      double(s.tokens) / s.seconds, s.MeanTtftMs(), Percentile(s.ttft_us, 0.5),
      Percentile(s.ttft_us, 0.9), s.seconds);
  if (exposed) std::printf("  exposed transfer mean %.2f ms", s.MeanExposedMs());
  std::printf("\n");
}

// What one phase (one layer-wise setting) measured, per rate.
struct PhaseResult {
  bool started = false;
  int differ = 0, failed = 0;
  std::vector<double> gap_ms;  // mean TTFT disaggregated - colocated, per rate
  std::vector<double> exposed_ms;
  // Per rate, over every turn: KV bytes moved (disaggregated), and the mean TTFT of the turns
  // after the first (the ones a decode prefix can shorten).
  std::vector<uint64_t> kv_bytes;
  std::vector<double> later_ttft_ms;
  // Per rate, the last turn's mean TTFT and transfer time (decode's) of the disaggregated run.
  std::vector<double> ttft_ms;
  std::vector<double> transfer_ms;
};

// The next turn's prompt: this turn's prompt, its output, then a few new tokens (the user's
// next message), the same for a given seed.
std::vector<int32_t> NextTurn(const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& output, uint64_t seed, int turn,
                              size_t i) {
  std::vector<int32_t> next = prompt;
  next.insert(next.end(), output.begin(), output.end());
  std::mt19937_64 rng(seed * 104729 + static_cast<uint64_t>(turn) * 131 + i);
  const size_t fresh = 6 + i % 11;
  for (size_t k = 0; k < fresh; ++k) next.push_back(int32_t(rng() % 512));
  return next;
}

// Starts a deployment with the prefill hosts' layer-wise streaming `layerwise`, runs the batch at
// every rate through it and through the colocated host, prints the table and summaries.
PhaseResult RunPhase(const Args& args, bool layerwise, bool prefix_reuse,
                     const std::string& direction,
                     const std::vector<std::vector<int32_t>>& first_prompts) {
  Args a = args;
  a.d.layerwise = layerwise;
  a.d.direction = direction;
  a.d.prefix_cache_pages = prefix_reuse ? kPrefixCachePages : 0;
  if (args.layerwise.size() > 1) {  // each phase keeps its own logs
    a.d.log_dir += layerwise ? "/layerwise-on" : "/layerwise-off";
    std::filesystem::create_directories(a.d.log_dir);
  }
  if (args.prefix_reuse.size() > 1) {
    a.d.log_dir += prefix_reuse ? "/prefix-reuse-on" : "/prefix-reuse-off";
    std::filesystem::create_directories(a.d.log_dir);
  }
  if (args.direction.size() > 1) {
    a.d.log_dir += "/" + direction;
    std::filesystem::create_directories(a.d.log_dir);
  }
  PhaseResult ph;
  const std::string where =
      a.d.netns ? (a.d.link_mbit > 0 ? "each in a network namespace (links capped at " +
                                           std::to_string(a.d.link_mbit) + " Mbit/s)"
                                     : std::string("each in a network namespace"))
                : std::string("on 127.0.0.1");
  std::printf(
      "pd-demo: starting %s, %zu prefill (tp %d, pp %d), %d decode (tp %d, pp %d), "
      "colocated and router %s (backend %s, model %s, hosts on %s, colocated reference on %s, "
      "layer-wise streaming %s, decode prefix reuse %s, %s); logs in %s\n",
      a.d.discovery == "etcd" ? "etcd" : "bootstrap", a.d.prefills.size(), a.d.prefills[0].tp,
      a.d.prefills[0].pp, a.d.decodes, a.d.decode_tp, a.d.decode_pp, where.c_str(),
      a.d.backend.c_str(), a.d.model.c_str(), DeviceName(a.d, a.d.device).c_str(),
      DeviceName(a.d, a.d.colocated_device).c_str(), layerwise ? "on" : "off",
      prefix_reuse ? "on" : "off", direction.c_str(), a.d.log_dir.c_str());
  std::fflush(stdout);
  const auto t0 = Clock::now();
  auto dep = Deployment::Start(a.d);
  if (!dep.ok()) {
    std::fprintf(stderr, "pd-demo: %s\n", dep.status().ToString().c_str());
    return ph;
  }
  ph.started = true;
  std::printf(
      "pd-demo: ready in %.1f s; router at %s (HTTP: curl -s %s:%d/v1/completions "
      "-d '{\"prompt\":\"hello\",\"max_tokens\":8}')\n",
      std::chrono::duration<double>(Clock::now() - t0).count(), (*dep)->router_address().c_str(),
      a.d.netns ? (*dep)->host_ip("router").c_str() : "127.0.0.1", (*dep)->http_port());
  // One short warm-up request per path, not counted (first-use costs are not the subject).
  // Its tokens are none of the prompts' (so that a decode prefix cache cannot hit on them).
  const std::vector<int32_t> warm = {511, 510, 509, 508, 507, 506, 505, 504};
  (*dep)->Generate(warm, 2);
  (*dep)->GenerateColocated(warm, 2);
  for (double rate : a.rates) {
    uint64_t kv_bytes = 0;
    std::vector<int64_t> later_ttft;
    std::vector<std::vector<int32_t>> prompts = first_prompts;
    for (int turn = 0; turn < a.turns; ++turn) {
      RunStats ds, cs;
      auto disagg = RunBatch(
          prompts, rate,
          [&](const std::vector<int32_t>& p) { return (*dep)->Generate(p, a.max_new_tokens); },
          &ds);
      auto coloc = RunBatch(
          prompts, rate,
          [&](const std::vector<int32_t>& p) {
            return (*dep)->GenerateColocated(p, a.max_new_tokens);
          },
          &cs);
      for (const Outcome& d : disagg) kv_bytes += d.kv_bytes;
      if (turn > 0) later_ttft.insert(later_ttft.end(), ds.ttft_us.begin(), ds.ttft_us.end());
      if (a.turns > 1) std::printf("\nturn %d of %d\n", turn + 1, a.turns);
      if (!a.quiet) {
        std::printf("\n%4s %6s %4s %9s %11s %10s %9s %12s  %s\n", "req", "prompt", "out", "ttft_ms",
                    "transfer_ms", "exposed_ms", "kv_bytes", "coloc_ttft", "output");
      }
      for (size_t i = 0; i < prompts.size(); ++i) {
        const Outcome& d = disagg[i];
        const Outcome& c = coloc[i];
        const bool same = d.ok && c.ok && d.output_ids == c.output_ids &&
                          int(d.output_ids.size()) == a.max_new_tokens;
        if (!d.ok || !c.ok)
          ++ph.failed;
        else if (!same)
          ++ph.differ;
        if (!a.quiet || !same) {
          std::printf("%4zu %6zu %4zu %9.1f %11.2f %10.2f %9llu %12.1f  %s\n", i, prompts[i].size(),
                      d.output_ids.size(), double(d.ttft_us) / 1000, double(d.transfer_us) / 1000,
                      double(d.exposed_transfer_us) / 1000,
                      static_cast<unsigned long long>(d.kv_bytes), double(c.ttft_us) / 1000,
                      same    ? "identical"
                      : !d.ok ? ("FAILED: " + d.reason).c_str()
                      : !c.ok ? ("colocated FAILED: " + c.reason).c_str()
                              : "DIFFERS from the colocated run");
        }
      }
      std::printf("\n");
      PrintSummary("disaggregated", rate, ds, true);
      PrintSummary("colocated", rate, cs, false);
      if (turn + 1 == a.turns) {
        ph.gap_ms.push_back(ds.MeanTtftMs() - cs.MeanTtftMs());
        ph.exposed_ms.push_back(ds.MeanExposedMs());
        ph.ttft_ms.push_back(ds.MeanTtftMs());
        double transfer = 0;
        for (const Outcome& d : disagg) transfer += double(d.transfer_us) / 1000.0;
        ph.transfer_ms.push_back(disagg.empty() ? 0 : transfer / double(disagg.size()));
      }
      // The conversation goes on with the reference's output (the disaggregated one equals it
      // when the run is right; a difference is counted above either way).
      for (size_t i = 0; i < prompts.size(); ++i) {
        prompts[i] = NextTurn(prompts[i], coloc[i].output_ids, a.d.seed, turn, i);
      }
    }
    ph.kv_bytes.push_back(kv_bytes);
    ph.later_ttft_ms.push_back(RunStats::Mean(later_ttft));
    if (a.turns > 1) {
      std::printf(
          "%d turns: KV bytes moved %llu, mean TTFT of turns 2..%d %.1f ms (decode prefix "
          "reuse %s)\n",
          a.turns, static_cast<unsigned long long>(kv_bytes), a.turns, ph.later_ttft_ms.back(),
          prefix_reuse ? "on" : "off");
    }
  }
  if (ph.differ + ph.failed > 0) std::fprintf(stderr, "%s", (*dep)->LogTails().c_str());
  std::printf("\n");
  return ph;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.d.prefill_bin = PD_DEMO_PREFILL_BIN;
  a.d.decode_bin = PD_DEMO_DECODE_BIN;
  a.d.router_bin = PD_DEMO_ROUTER_BIN;
  a.d.bootstrap_bin = PD_DEMO_BOOTSTRAP_BIN;
  if (!ParseArgs(argc, argv, &a)) return 2;
  if (a.d.device == "cuda" || a.d.colocated_device == "cuda") {
    // Before any process starts: every host would refuse with the same reason.
    const pdlib::kernels::CudaInfo cuda = pdlib::kernels::ProbeCuda();
    if (cuda.device_count == 0) {
      std::fprintf(stderr, "pd-demo: --%s cuda: no CUDA device: %s\n",
                   a.d.device == "cuda" ? "device" : "reference-device", cuda.reason.c_str());
      return 1;
    }
    if (a.d.cuda_device >= cuda.device_count) {
      std::fprintf(stderr, "pd-demo: --cuda-device %d: this machine has %d CUDA device(s)\n",
                   a.d.cuda_device, cuda.device_count);
      return 2;
    }
  }
  if (a.d.log_dir.empty()) {
    char tmpl[] = "/tmp/pd-demo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      std::perror("pd-demo: mkdtemp");
      return 1;
    }
    a.d.log_dir = tmpl;
  }
  std::filesystem::create_directories(a.d.log_dir);
  const auto prompts = MakePrompts(a.requests, a.d.seed);
  std::vector<PhaseResult> phases;
  for (bool layerwise : a.layerwise) {
    for (bool reuse : a.prefix_reuse) {
      for (const std::string& direction : a.direction) {
        PhaseResult ph = RunPhase(a, layerwise, reuse, direction, prompts);
        if (!ph.started) return 1;
        phases.push_back(std::move(ph));
      }
    }
  }
  int differ = 0, failed = 0;
  for (const PhaseResult& ph : phases) {
    differ += ph.differ;
    failed += ph.failed;
  }
  if (a.prefix_reuse.size() == 2) {
    for (size_t k = 0; k < a.rates.size(); ++k) {
      const uint64_t off = phases[0].kv_bytes[k], on = phases[1].kv_bytes[k];
      std::printf(
          "\ndecode prefix reuse, %d turns, rate %s: KV bytes moved %llu off, %llu on (%.0f%% "
          "less); mean TTFT of turns 2..%d %.1f ms off, %.1f ms on\n",
          a.turns, a.rates[k] > 0 ? std::to_string(int(a.rates[k])).c_str() : "burst",
          static_cast<unsigned long long>(off), static_cast<unsigned long long>(on),
          off > 0 ? 100.0 * double(off - std::min(on, off)) / double(off) : 0.0, a.turns,
          phases[0].later_ttft_ms[k], phases[1].later_ttft_ms[k]);
    }
  }
  if (a.layerwise.size() == 2) {
    for (size_t k = 0; k < a.rates.size(); ++k) {
      const double off = phases[0].gap_ms[k], on = phases[1].gap_ms[k];
      std::printf(
          "\nlayer-wise streaming, rate %s: mean TTFT gap disaggregated - colocated %.1f ms off, "
          "%.1f ms on (%.0f%% smaller); exposed transfer %.2f ms off, %.2f ms on\n",
          a.rates[k] > 0 ? std::to_string(int(a.rates[k])).c_str() : "burst", off, on,
          off > 0 ? 100.0 * (off - on) / off : 0.0, phases[0].exposed_ms[k],
          phases[1].exposed_ms[k]);
    }
  }
  if (a.direction.size() == 2) {
    for (size_t k = 0; k < a.rates.size(); ++k) {
      std::printf(
          "\npush vs pull, rate %s: mean TTFT %.1f ms push, %.1f ms pull; mean transfer %.2f ms "
          "push, %.2f ms pull; exposed transfer %.2f ms push, %.2f ms pull; KV bytes moved %llu "
          "push, %llu pull\n",
          a.rates[k] > 0 ? std::to_string(int(a.rates[k])).c_str() : "burst", phases[0].ttft_ms[k],
          phases[1].ttft_ms[k], phases[0].transfer_ms[k], phases[1].transfer_ms[k],
          phases[0].exposed_ms[k], phases[1].exposed_ms[k],
          static_cast<unsigned long long>(phases[0].kv_bytes[k]),
          static_cast<unsigned long long>(phases[1].kv_bytes[k]));
    }
  }
  const int total = a.requests * a.turns * int(a.rates.size()) * int(phases.size());
  const int identical = total - differ - failed;
  std::printf("\n%d/%d outputs identical to the colocated run", identical, total);
  if (a.d.device != a.d.colocated_device) {
    std::printf(" (hosts on %s, colocated reference on %s)", DeviceName(a.d, a.d.device).c_str(),
                DeviceName(a.d, a.d.colocated_device).c_str());
  }
  if (differ + failed > 0) std::printf(" (%d differ, %d failed)", differ, failed);
  std::printf("\n");
  std::fflush(stdout);
  return differ + failed == 0 ? 0 : 1;
}
