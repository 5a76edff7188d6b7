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
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "examples/router/router.h"

namespace {

constexpr char kUsage[] =
    "usage: pd-router --prefill HOST:PORT [--prefill ...] --decode HOST:PORT [--decode ...]\n"
    "                 [options]\n"
    "\n"
    "Routes each request to one prefill and one decode host of the example deployment (their\n"
    "gRPC Host service), streams decode's tokens back, and reports the outcome.\n"
    "\n"
    "  --prefill HOST:PORT       a prefill host's gRPC address (repeat for more)\n"
    "  --decode HOST:PORT        a decode host's gRPC address (repeat for more)\n"
    "  --host ADDR               address to serve on (default 127.0.0.1)\n"
    "  --port N                  gRPC Router service port; 0 picks a free one (default 0)\n"
    "  --http-port N             HTTP/JSON port; 0 picks a free one, -1 turns HTTP off\n"
    "                            (default 0)\n"
    "  --policy P                random | power-of-two | least-loaded (default power-of-two),\n"
    "                            applied to prefill and decode hosts independently. Load is the\n"
    "                            router's in-flight requests on a host, or the host's running +\n"
    "                            queued from GetLoad when higher. power-of-two: two distinct\n"
    "                            random hosts, the less loaded. least-loaded: ties are broken at\n"
    "                            random. A host whose RPC failed with UNAVAILABLE is skipped\n"
    "                            for --unavailable-backoff-ms or until it answers GetLoad again.\n"
    "  --max-new-tokens N        default for requests that do not say (default 16)\n"
    "  --seed N                  seed for the policies and the bootstrap rooms (default: random)\n"
    "  --request-timeout-ms MS   a request fails after MS (default 60000)\n"
    "  --startup-timeout-ms MS   wait this long for every host to answer GetLoad (default 30000)\n"
    "  --load-poll-ms MS         GetLoad refresh interval (default 500)\n"
    "  --unavailable-backoff-ms MS  (default 5000)\n"
    "  --help                    this text\n"
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
  std::fprintf(stderr, "pd-router: %s\n\n%s", why.c_str(), kUsage);
  return 2;
}

template <typename T>
bool ParseInt(std::string_view s, T* out) {
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return !s.empty() && ec == std::errc() && ptr == s.data() + s.size();
}

}  // namespace

int main(int argc, char** argv) {
  pdlib::router::RouterOptions options;
  options.progress = [](const std::string& line) {
    std::fprintf(stderr, "pd-router: %s\n", line.c_str());
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) return Usage("missing value after " + std::string(arg));
    const std::string_view value = argv[++i];
    int64_t n = 0;
    uint64_t u = 0;
    const bool is_int = ParseInt(value, &n);
    auto ms = [&](std::chrono::milliseconds* out) {
      if (!is_int || n < 0) return false;
      *out = std::chrono::milliseconds(n);
      return true;
    };
    bool ok = true;
    if (arg == "--prefill") {
      options.prefill_hosts.emplace_back(value);
    } else if (arg == "--decode") {
      options.decode_hosts.emplace_back(value);
    } else if (arg == "--host") {
      options.host = std::string(value);
    } else if (arg == "--port") {
      ok = is_int && n >= 0 && n <= 65535;
      options.port = static_cast<int32_t>(n);
    } else if (arg == "--http-port") {
      ok = is_int && n >= -1 && n <= 65535;
      options.http_port = static_cast<int32_t>(n);
    } else if (arg == "--policy") {
      auto policy = pdlib::router::ParsePolicy(value);
      if (!policy.ok()) return Usage(std::string(policy.status().message()));
      options.policy = *policy;
    } else if (arg == "--max-new-tokens") {
      ok = is_int && n >= 1 && n <= INT32_MAX;
      options.default_max_new_tokens = static_cast<int32_t>(n);
    } else if (arg == "--seed") {
      ok = ParseInt(value, &u);
      options.seed = u;
    } else if (arg == "--request-timeout-ms") {
      ok = ms(&options.request_timeout) && n > 0;
    } else if (arg == "--startup-timeout-ms") {
      ok = ms(&options.startup_timeout);
    } else if (arg == "--load-poll-ms") {
      ok = ms(&options.load_poll_interval) && n > 0;
    } else if (arg == "--unavailable-backoff-ms") {
      ok = ms(&options.unavailable_backoff);
    } else {
      return Usage("unknown option " + std::string(arg));
    }
    if (!ok) return Usage("bad value for " + std::string(arg) + ": '" + std::string(value) + "'");
  }
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
