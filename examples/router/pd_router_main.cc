// pd-router: the example deployment's router (issue #8). Serves service Router of
// examples/proto/pd_serving.proto over gRPC and POST /v1/completions over HTTP/JSON, and runs
// each request on a prefill and a decode host picked by --policy. See --help and README.md.
//
// Once every host answered GetLoad it prints one line on stdout,
//   READY role=router port=<grpc port> http_port=<http port>
// and serves until SIGTERM or SIGINT. Exit status 0 after a signal, 1 on a startup error, 2 on
// a usage error.
#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "examples/router/router.h"
#include "tools/common/flags.h"

ABSL_FLAG(std::vector<std::string>, prefill, {},
          "prefill hosts' gRPC addresses, HOST:PORT (comma-separated, or repeat the flag)");
ABSL_FLAG(std::vector<std::string>, decode, {},
          "decode hosts' gRPC addresses, HOST:PORT (comma-separated, or repeat the flag)");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to serve on");
ABSL_FLAG(int32_t, port, 0, "gRPC Router service port; 0 picks a free one");
ABSL_FLAG(int32_t, http_port, 0, "HTTP/JSON port; 0 picks a free one, -1 turns HTTP off");
ABSL_FLAG(std::string, policy, "power-of-two",
          "random | power-of-two | least-loaded (see the policies above)");
ABSL_FLAG(int32_t, max_new_tokens, 16, "default for requests that do not say");
ABSL_FLAG(std::string, seed, "", "seed for the policies and the bootstrap rooms (\"\": random)");
ABSL_FLAG(int64_t, request_timeout_ms, 60000, "a request fails after this long");
ABSL_FLAG(int64_t, startup_timeout_ms, 30000, "wait this long for every host to answer GetLoad");
ABSL_FLAG(int64_t, load_poll_ms, 500, "GetLoad refresh interval");
ABSL_FLAG(int64_t, unavailable_backoff_ms, 5000,
          "how long a host whose RPC failed with UNAVAILABLE is skipped");

namespace {

constexpr char kUsage[] =
    "usage: pd-router --prefill HOST:PORT[,...] --decode HOST:PORT[,...] [flags]\n"
    "\n"
    "Routes each request to one prefill and one decode host of the example deployment (their\n"
    "gRPC Host service), streams decode's tokens back, and reports the outcome.\n"
    "\n"
    "Policies (--policy), applied to prefill and decode hosts independently. Load is the\n"
    "router's in-flight requests on a host, or the host's running + queued from GetLoad when\n"
    "higher. power-of-two: two distinct random hosts, the less loaded. least-loaded: ties are\n"
    "broken at random. A host whose RPC failed with UNAVAILABLE is skipped for\n"
    "--unavailable_backoff_ms or until it answers GetLoad again.\n"
    "\n"
    "Tokenizer: the example's stand-in is byte-level: prompt text becomes one token per byte\n"
    "(id = byte value) and output ids below 256 are bytes again, others print as \"<id>\".\n"
    "\n"
    "HTTP: POST /v1/completions {\"prompt\": \"text\" or [ids], \"max_tokens\": N,\n"
    "\"stream\": false|true}, GET /health, GET /metrics (Prometheus). Example:\n"
    "  curl -s localhost:PORT/v1/completions -d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'\n";

// The stop-signal thread and main (see main).
sigset_t g_stop_signals;
std::mutex g_mu;
std::condition_variable g_cv;
bool g_serving = false;  // guarded by g_mu
int g_stop_signal = 0;   // guarded by g_mu

int Usage(const std::string& why) {
  std::fprintf(stderr, "pd-router: %s (see --help)\n", why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  pdlib::router::RouterOptions options;
  options.progress = [](const std::string& line) {
    std::fprintf(stderr, "pd-router: %s\n", line.c_str());
  };
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage, {"prefill", "decode"});
  options.prefill_hosts = absl::GetFlag(FLAGS_prefill);
  options.decode_hosts = absl::GetFlag(FLAGS_decode);
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  if (options.port < 0 || options.port > 65535) return Usage("--port must be in [0, 65535]");
  options.http_port = absl::GetFlag(FLAGS_http_port);
  if (options.http_port < -1 || options.http_port > 65535) {
    return Usage("--http_port must be in [-1, 65535]");
  }
  auto policy = pdlib::router::ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) return Usage("--policy: " + std::string(policy.status().message()));
  options.policy = *policy;
  options.default_max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  if (options.default_max_new_tokens < 1) return Usage("--max_new_tokens must be >= 1");
  if (const std::string seed = absl::GetFlag(FLAGS_seed); !seed.empty()) {
    uint64_t u = 0;
    if (!absl::SimpleAtoi(seed, &u)) return Usage("--seed '" + seed + "' is not a number");
    options.seed = u;
  }
  const std::pair<const char*, int64_t> ms[] = {
      {"--request_timeout_ms", absl::GetFlag(FLAGS_request_timeout_ms)},
      {"--startup_timeout_ms", absl::GetFlag(FLAGS_startup_timeout_ms)},
      {"--load_poll_ms", absl::GetFlag(FLAGS_load_poll_ms)},
      {"--unavailable_backoff_ms", absl::GetFlag(FLAGS_unavailable_backoff_ms)}};
  for (const auto& [name, value] : ms) {
    if (value < 0) return Usage(std::string(name) + " must be >= 0");
  }
  if (ms[0].second == 0 || ms[2].second == 0) {
    return Usage("--request_timeout_ms and --load_poll_ms must be > 0");
  }
  options.request_timeout = std::chrono::milliseconds(ms[0].second);
  options.startup_timeout = std::chrono::milliseconds(ms[1].second);
  options.load_poll_interval = std::chrono::milliseconds(ms[2].second);
  options.unavailable_backoff = std::chrono::milliseconds(ms[3].second);
  if (options.prefill_hosts.empty() || options.decode_hosts.empty()) {
    return Usage("give at least one --prefill and one --decode host");
  }

  // Block the stop signals in every thread (gRPC's included, which inherit the mask); one thread
  // takes them with sigwait. A signal while the router waits for its hosts ends the process at
  // once (nothing to clean up yet); after READY it shuts the router down.
  sigemptyset(&g_stop_signals);
  sigaddset(&g_stop_signals, SIGTERM);
  sigaddset(&g_stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &g_stop_signals, nullptr);
  std::thread([] {
    int sig = 0;
    while (sigwait(&g_stop_signals, &sig) != 0) {
    }
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_serving) {
      std::fprintf(stderr, "pd-router: signal %d while waiting for hosts, exiting\n", sig);
      std::_Exit(1);
    }
    g_stop_signal = sig;
    g_cv.notify_all();
  }).detach();  // touches only globals, so it may outlive main

  auto router = pdlib::router::Router::Start(options);
  if (!router.ok()) {
    std::fprintf(stderr, "pd-router: %s\n", router.status().ToString().c_str());
    return 1;
  }
  std::unique_lock<std::mutex> lock(g_mu);
  g_serving = true;
  std::printf("READY role=router port=%d http_port=%d\n", (*router)->grpc_port(),
              (*router)->http_port());
  std::fflush(stdout);
  g_cv.wait(lock, [] { return g_stop_signal != 0; });
  std::fprintf(stderr, "pd-router: signal %d, shutting down\n", g_stop_signal);
  lock.unlock();
  (*router)->Shutdown();
  return 0;
}
