// pdlib-chaos: requests between real prefill and decode processes while they are killed
// (SIGKILL) and frozen (SIGSTOP/SIGCONT) at random moments; every request must end (no hang),
// every Success must carry the request's bytes, and nothing may be left held at the end.
//
//   pdlib-chaos [--requests N] [--topology 1p1d|2p2d|both] [--seed S] [--rate R]
//       [--fault-interval-ms MS] [--fault-kinds kill,stop|kill|stop|none] [--stop-ms MS]
//       [--hang-bound-ms MS] [--backend ucx|fake] [--backend-option KEY=VALUE]...
//       [--json] [--verbose] [--log-dir DIR] [--min-faults N] [...]  (--help lists all)
//
//   e.g.  UCX_TLS=shm pdlib-chaos --requests 1000 --json
//
// The driver hosts the bootstrap server and starts this binary again as each prefill and decode
// process (chaos_peer.h); 2p2d is two prefill DP ranks of one deployment and two decode
// processes, a request going to one of each (room % 2 picks the prefill). See chaos_driver.h for
// what is counted and chaos_report.h for the figures. Exit status: 0 when hung, bad_bytes,
// stale_writes, leaked, crashes, unclean exits, restart failures and failed probes are all 0
// (and faults >= --min-faults); 1 otherwise; 2 on bad usage; 3 when a process could not be
// started.
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/pdlib.h"
#include "tools/chaos/chaos_driver.h"
#include "tools/chaos/chaos_pattern.h"
#include "tools/chaos/chaos_peer.h"
#include "tools/chaos/chaos_report.h"

// ThreadSanitizer builds: Debian's gRPC, protobuf and Abseil are not instrumented. Weak, so a
// definition elsewhere wins; TSAN_OPTIONS from the environment still applies on top.
#if defined(__SANITIZE_THREAD__)
extern "C" __attribute__((weak, visibility("default"))) const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1:suppressions=" PDLIB_TSAN_SUPPRESSIONS;
}
#endif

namespace pdlib_chaos {
namespace {

constexpr char kUsage[] =
    "usage: pdlib-chaos [options]\n"
    "\n"
    "Runs requests between prefill and decode processes while killing (SIGKILL) and freezing\n"
    "(SIGSTOP/SIGCONT) them at random moments; checks that every request ends within the hang\n"
    "bound, that every Success carries the request's bytes, and that nothing is left held.\n"
    "\n"
    "  --requests N            requests in all (default 1000; split between topologies)\n"
    "  --topology T            1p1d, 2p2d or both (default both)\n"
    "  --seed S                seeds the fault schedule and the routing (default 1)\n"
    "  --rate R                requests started per second, 0: unpaced (default 50)\n"
    "  --concurrency C         requests in flight per process at most (default 16)\n"
    "  --fault-interval-ms MS  mean time between faults, each uniform in [MS/2, 3MS/2]\n"
    "                          (default 700)\n"
    "  --fault-kinds K         kill,stop | kill | stop | none (default kill,stop)\n"
    "  --stop-ms MS            mean freeze, each uniform in [MS/2, 3MS/2] (default 1500)\n"
    "  --hang-bound-ms MS      a room must be terminal this long after its start or the last\n"
    "                          fault event of its processes (default: bootstrap + waiting +\n"
    "                          transfer + liveness timeouts + 2000)\n"
    "  --backend NAME          ucx (default) or fake (moves no bytes: bytes are not checked)\n"
    "  --backend-option K=V    a KVManagerOptions::backend_options entry, e.g. ucx.tls=shm\n"
    "  --liveness-ms MS        KVManagerOptions::liveness_timeout (default 1000)\n"
    "  --connect-timeout-ms MS connect_timeout (default 2000)\n"
    "  --bootstrap-timeout-ms MS, --waiting-timeout-ms MS, --transfer-timeout-ms MS\n"
    "                          the per-state timeouts (default 3000 each)\n"
    "  --layers L              layers, a K and a V buffer each (default 2)\n"
    "  --item-bytes B          bytes per KV page and buffer (default 4096)\n"
    "  --max-pages P           pages per request, each request 1..P (default 8)\n"
    "  --max-chunks C          Send() calls per request, 1..C (default 3)\n"
    "  --prefill-ms MS         mean simulated forward pass per request before its chunks go,\n"
    "                          uniform in [0, 2MS] (default 100)\n"
    "  --json                  print one JSON object on stdout (the summary goes to stderr)\n"
    "  --verbose               print every fault, restart and failed room on stderr\n"
    "  --log-dir DIR           keep the processes' stderr here (default: a temporary\n"
    "                          directory, removed after a clean run)\n"
    "  --min-faults N          exit 1 when fewer than N faults were injected (default 0)\n"
    "  --corrupt-kv-one-in N, --corrupt-aux-one-in N\n"
    "                          negative controls: prefill spoils one KV byte / one aux value of\n"
    "                          about one request in N, which must show up as bad_bytes\n"
    "  --corrupt-free-one-in N negative control: decode overwrites a byte of a page it took\n"
    "                          back from about one request in N: must show up as stale_writes\n"
    "  --help                  this text\n";

struct Flags {
  uint64_t requests = 1000;
  std::string topology = "both";
  bool json = false;
  uint64_t min_faults = 0;
  std::string role;  // hidden: "prefill" or "decode" in the child processes
  ChaosOptions chaos;
};

bool ParseU64(std::string_view text, uint64_t* out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

bool ParseI64(std::string_view text, int64_t* out, int64_t min) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && *out >= min;
}

bool ParseSize(std::string_view text, size_t* out, size_t min) {
  uint64_t v = 0;
  if (!ParseU64(text, &v) || v < min || v > (uint64_t{1} << 30)) return false;
  *out = size_t(v);
  return true;
}

// Accepts "--flag value" and "--flag=value"; prints why and returns false on bad input.
bool ParseFlags(int argc, char** argv, Flags* f) {
  ChaosOptions& c = f->chaos;
  PeerConfig& p = c.peer;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (arg == "--json" || arg == "--verbose" || arg == "--no-verify") {
      (arg == "--json"      ? f->json
       : arg == "--verbose" ? c.verbose
                            : p.verify) = arg != "--no-verify";
      continue;
    }
    std::string_view value;
    if (size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      std::fprintf(stderr, "pdlib-chaos: %s needs a value\n%s", argv[i], kUsage);
      return false;
    }
    uint64_t n = 0;
    bool ok = true;
    if (arg == "--requests") {
      ok = ParseU64(value, &f->requests) && f->requests > 0;
    } else if (arg == "--topology") {
      f->topology = value;
      ok = value == "1p1d" || value == "2p2d" || value == "both";
    } else if (arg == "--seed") {
      ok = ParseU64(value, &c.seed);
    } else if (arg == "--rate") {
      ok = ParseU64(value, &n);
      c.rate = double(n);
    } else if (arg == "--concurrency") {
      ok = ParseSize(value, &p.concurrency, 1);
    } else if (arg == "--fault-interval-ms") {
      ok = ParseI64(value, &c.fault_interval_ms, 10);
    } else if (arg == "--fault-kinds") {
      c.kill_faults = value == "kill,stop" || value == "stop,kill" || value == "kill";
      c.stop_faults = value == "kill,stop" || value == "stop,kill" || value == "stop";
      ok = c.kill_faults || c.stop_faults || value == "none";
    } else if (arg == "--stop-ms") {
      ok = ParseI64(value, &c.stop_ms, 1);
    } else if (arg == "--hang-bound-ms") {
      ok = ParseI64(value, &c.hang_bound_ms, 1);
    } else if (arg == "--backend") {
      p.backend = value;
      ok = !value.empty();
    } else if (arg == "--backend-option") {
      const size_t eq = value.find('=');
      ok = eq != std::string_view::npos && eq > 0;
      if (ok) p.backend_options[std::string(value.substr(0, eq))] = value.substr(eq + 1);
    } else if (arg == "--liveness-ms") {
      ok = ParseI64(value, &p.liveness_ms, 1000);
    } else if (arg == "--connect-timeout-ms") {
      ok = ParseI64(value, &p.connect_ms, 1);
    } else if (arg == "--bootstrap-timeout-ms") {
      ok = ParseI64(value, &p.bootstrap_ms, 1);
    } else if (arg == "--waiting-timeout-ms") {
      ok = ParseI64(value, &p.waiting_ms, 1);
    } else if (arg == "--transfer-timeout-ms") {
      ok = ParseI64(value, &p.transfer_ms, 1);
    } else if (arg == "--layers") {
      ok = ParseSize(value, &p.layers, 1);
    } else if (arg == "--item-bytes") {
      ok = ParseSize(value, &p.item_bytes, 8);
    } else if (arg == "--max-pages") {
      ok = ParseSize(value, &p.max_pages, 1);
    } else if (arg == "--max-chunks") {
      ok = ParseSize(value, &p.max_chunks, 1);
    } else if (arg == "--prefill-ms") {
      ok = ParseI64(value, &p.prefill_ms, 0);
    } else if (arg == "--log-dir") {
      c.log_dir = value;
    } else if (arg == "--min-faults") {
      ok = ParseU64(value, &f->min_faults);
    } else if (arg == "--corrupt-kv-one-in") {
      ok = ParseU64(value, &p.corrupt_kv_one_in);
    } else if (arg == "--corrupt-aux-one-in") {
      ok = ParseU64(value, &p.corrupt_aux_one_in);
    } else if (arg == "--corrupt-free-one-in") {
      ok = ParseU64(value, &p.corrupt_free_one_in);
    } else if (arg == "--role") {  // the flags below are the driver's to its children
      f->role = value;
      ok = value == "prefill" || value == "decode";
      p.mode = value == "prefill" ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
    } else if (arg == "--bootstrap-port") {
      ok = ParseU64(value, &n) && n > 0 && n < 65536;
      p.bootstrap_port = uint16_t(n);
    } else if (arg == "--dp-size" || arg == "--dp-rank") {
      ok = ParseU64(value, &n) && n < 1024;
      (arg == "--dp-size" ? p.dp_size : p.dp_rank) = int32_t(n);
    } else if (arg == "--max-seconds") {
      ok = ParseI64(value, &p.max_seconds, 1);
    } else {
      std::fprintf(stderr, "pdlib-chaos: unknown option %s\n%s", argv[i], kUsage);
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "pdlib-chaos: bad value '%.*s' for %.*s\n", int(value.size()),
                   value.data(), int(arg.size()), arg.data());
      return false;
    }
  }
  return true;
}

std::string TransportOf(const PeerConfig& p) {
  if (p.backend != "ucx") return p.backend;
  if (auto it = p.backend_options.find("ucx.tls"); it != p.backend_options.end()) {
    return "ucx.tls=" + it->second;
  }
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr ? std::string("UCX_TLS=") + env : "UCX's choice";
}

int RunDriver(Flags f) {
  ChaosOptions& c = f.chaos;
  const auto known = pdlib::ListBackends();
  if (std::find(known.begin(), known.end(), c.peer.backend) == known.end()) {
    std::string names;
    for (const auto& k : known) names += " " + k;
    std::fprintf(stderr, "pdlib-chaos: backend '%s' is not in this build (known:%s)\n",
                 c.peer.backend.c_str(), names.c_str());
    return 2;
  }
  // The fake backend moves no bytes: there is nothing on decode to check.
  if (c.peer.backend == "fake") c.peer.verify = false;
  const double paced_s = c.rate > 0 ? double(f.requests) / c.rate : double(f.requests) * 0.05;
  c.peer.max_seconds = int64_t(paced_s * 4) + 600;

  const bool own_log_dir = c.log_dir.empty();
  if (own_log_dir) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != 0 ? tmp : "/tmp") + "/pdlib-chaos-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("pdlib-chaos: mkdtemp");
      return 3;
    }
    c.log_dir = pattern;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(c.log_dir, ec);
  }

  struct Plan {
    std::string name;
    int prefills, decodes;
    uint64_t requests;
  };
  std::vector<Plan> plans;
  if (f.topology == "1p1d") plans.push_back({"1p1d", 1, 1, f.requests});
  if (f.topology == "2p2d") plans.push_back({"2p2d", 2, 2, f.requests});
  if (f.topology == "both") {
    plans.push_back({"1p1d", 1, 1, f.requests / 2});
    plans.push_back({"2p2d", 2, 2, f.requests - f.requests / 2});
  }

  Report report;
  report.backend = c.peer.backend;
  report.transport = TransportOf(c.peer);
  report.bytes_checked = c.peer.verify;
  report.seed = c.seed;
  for (size_t k = 0; k < plans.size(); ++k) {
    const Plan& plan = plans[k];
    if (plan.requests == 0) continue;
    // Rooms random-looking and unique across topologies; even, so room % 2 is the DP rank.
    const uint64_t base = (Mix(c.seed * 31 + k) >> 3) & ~uint64_t{0xfffff};
    std::string error;
    Tally t = RunTopology(c, plan.name, plan.prefills, plan.decodes, plan.requests, base, &error);
    if (!error.empty()) {
      std::fprintf(stderr, "pdlib-chaos: %s: %s\nlogs kept in %s\n", plan.name.c_str(),
                   error.c_str(), c.log_dir.c_str());
      return 3;
    }
    report.total.Add(t);
    report.by_topology[plan.name] = std::move(t);
  }

  const Tally& t = report.total;
  const bool clean = t.Clean() && t.faults >= f.min_faults;
  std::fputs(RenderSummary(report).c_str(), f.json ? stderr : stdout);
  if (t.faults < f.min_faults) {
    std::fprintf(stderr, "pdlib-chaos: %llu faults, fewer than --min-faults %llu\n",
                 static_cast<unsigned long long>(t.faults),
                 static_cast<unsigned long long>(f.min_faults));
  }
  if (f.json) std::printf("%s\n", RenderJson(report).c_str());
  std::fflush(stdout);
  if (clean && own_log_dir) {
    std::error_code ec;
    std::filesystem::remove_all(c.log_dir, ec);
  } else {
    std::fprintf(stderr, "pdlib-chaos: the processes' logs are in %s\n", c.log_dir.c_str());
  }
  return clean ? 0 : 1;
}

}  // namespace
}  // namespace pdlib_chaos

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a dead child's stdin must not kill the driver
  pdlib_chaos::Flags flags;
  if (!pdlib_chaos::ParseFlags(argc, argv, &flags)) return 2;
  if (flags.role.empty()) return pdlib_chaos::RunDriver(std::move(flags));
  // A peer process: die with the driver, even when the driver is killed itself.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 4;
  return pdlib_chaos::RunPeer(flags.chaos.peer);
}
