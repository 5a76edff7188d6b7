#include "examples/hosts/host_flags.h"

#include <charconv>
#include <limits>
#include <string>

namespace pdlib::hosts {
namespace {

template <typename T>
bool ParseInt(std::string_view text, T min, T max, T* out) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
    return false;
  }
  *out = value;
  return true;
}

Status Bad(std::string_view flag, std::string_view value, std::string_view what) {
  return Status::InvalidArgument(std::string(flag) + " '" + std::string(value) +
                                 "': " + std::string(what));
}

}  // namespace

std::string HostUsage(Role program) {
  const bool prefill = program == Role::kPrefill;
  std::string u = prefill ? "usage: pd-prefill [flags]\n\n"
                            "Serves the prefill side of the example deployment (issue #8): runs "
                            "each request's\nprompt on the example model and sends its KV with "
                            "pdlib to the decode host that asks.\n"
                          : "usage: pd-decode [flags]\n\n"
                            "Serves the decode side of the example deployment (issue #8): receives "
                            "each request's KV\nfrom its prefill host with pdlib and generates its "
                            "tokens. With --colocated, prefills\nrequests itself instead (no "
                            "transfer): the baseline a disaggregated run is compared to.\n";
  u +=
      "\nServes gRPC service Host (examples/proto/pd_serving.proto). Once serving, prints one line "
      "on\nstdout: READY role=<role> port=<grpc port>";
  u += prefill ? " bootstrap=<host>:<port>\n" : "\n";
  u += "then serves until SIGINT or SIGTERM (in-flight requests fail with a reason). "
       "Diagnostics go\nto stderr.\n\n";
  u += "  --host HOST              address for gRPC";
  u += prefill ? " and the ranks' pdlib control endpoints\n                          " : "";
  u += " (default 127.0.0.1)\n"
       "  --port N                 gRPC port; 0 picks a free one (default 0)\n"
       "  --model NAME             small | small-hybrid (recurrent layers 1 and 3; mamba state)\n"
       "                           (default small)\n"
       "  --seed N                 random-weights seed; prefill and decode must agree (default "
       "1)\n";
  if (prefill) {
    u += "  --tp N                   tensor-parallel ranks (threads); each registers 1/N of the "
         "KV heads\n"
         "                           (default 1). The model is not sharded: every rank computes "
         "it whole\n"
         "  --pp N                   pipeline stages; stage s registers layers [s*L/N, "
         "(s+1)*L/N) (default 1)\n";
  } else {
    u += "  --tp 1, --pp 1           decode runs TP 1 and PP 1 only (one rank holds every head "
         "and layer;\n"
         "                           pdlib slices prefill's TP/PP shards into it)\n";
  }
  u += "  --threads N              model threads per rank; 0: hardware threads / ranks (default "
       "0)\n";
  if (!prefill) {
    u += "  --colocated              prefill on this host's own model, no pdlib (role "
         "colocated);\n"
         "                           requests' bootstrap fields are ignored\n";
  }
  u += "  --backend NAME           pdlib transport: ucx | fake | verbs (default ucx). fake moves "
       "no\n"
       "                           bytes: requests complete, tokens are wrong (control-plane "
       "tests)\n"
       "  --backend-option K=V     backend setting, repeatable (e.g. ucx.tls=shm, "
       "ucx.net_devices=lo)\n";
  if (prefill) {
    u += "  --bootstrap-host HOST    bootstrap server the ranks register with (default "
         "127.0.0.1)\n"
         "  --bootstrap-port N       its port (default 8998); with --start-bootstrap, 0 picks a "
         "free one\n"
         "  --start-bootstrap        run pdlib's bootstrap server in this process (in rank 0's "
         "manager;\n"
         "                           for port 0 the host runs it); otherwise a pdlib-bootstrap "
         "must run\n";
  }
  u += "  --num-pages N            KV pages per rank, 16 tokens each (default 512)\n"
       "  --max-running N          requests holding KV at once";
  u += prefill ? " (default 16)\n"
               : " (default 16); as many more\n"
                 "                           may be pre-allocated\n";
  u += "  --chunked-prefill-size N token budget of one prefill forward (default 512)\n"
       "  --max-context-len N      longest prompt";
  u += prefill ? "" : " + max_new_tokens";
  u += " accepted (default 4096)\n";
  if (!prefill) {
    u += "  --reserved-decode-tokens N  tokens kept free per admitted request (default 64)\n";
  }
  u += "  --bootstrap-timeout-ms N a request not bootstrapped within N ms fails (default 10000)\n"
       "  --waiting-timeout-ms N   a request waiting for its KV to be sent fails after N ms "
       "(default 60000)\n"
       "  --transfer-timeout-ms N  a transfer not done within N ms fails (default 30000)\n"
       "  --liveness-timeout-ms N  a silent peer is declared dead after N ms, >= 1000 (default "
       "5000)\n"
       "  --connect-timeout-ms N   connection set-up gives up after N ms (default 5000)\n";
  if (!prefill) {
    u += "  --connect HOST:PORT      warm up: connect to the prefill deployment whose bootstrap "
         "server\n"
         "                           is there before the first request (repeatable; a failure "
         "is logged)\n";
  }
  u += ""
       "  --idle-poll-us N         sleep between steps that only wait on the network (default "
       "500)\n"
       "  --verbose                pdlib info logs on stderr\n"
       "  --help                   this text\n";
  return u;
}

StatusOr<HostFlags> ParseHostFlags(Role program, std::span<const std::string_view> args) {
  HostFlags f;
  HostOptions& o = f.host;
  o.role = program;
  const bool prefill = program == Role::kPrefill;
  bool colocated = false;
  int32_t tp = 1, pp = 1;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    std::string_view value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take = [&]() -> Status {
      if (has_value) return Status::OK();
      if (i + 1 >= args.size()) {
        return Status::InvalidArgument(std::string(arg) + " needs a value");
      }
      value = args[++i];
      return Status::OK();
    };
    auto int_flag = [&](int32_t min, int32_t max, int32_t* out) -> Status {
      if (Status s = take(); !s.ok()) return s;
      if (!ParseInt<int32_t>(value, min, max, out)) {
        return Bad(arg, value,
                   "not an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
      }
      return Status::OK();
    };
    auto ms_flag = [&](int32_t min, std::chrono::milliseconds* out) -> Status {
      int32_t ms = 0;
      if (Status s = int_flag(min, std::numeric_limits<int32_t>::max(), &ms); !s.ok()) return s;
      *out = std::chrono::milliseconds(ms);
      return Status::OK();
    };
    constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
    Status s;
    if (arg == "--help" || arg == "-h") {
      f.help = true;
    } else if (arg == "--verbose" && !has_value) {
      f.verbose = true;
    } else if (arg == "--colocated" && !has_value && !prefill) {
      colocated = true;
    } else if (arg == "--start-bootstrap" && !has_value && prefill) {
      o.start_bootstrap = true;
    } else if (arg == "--host") {
      if (s = take(); s.ok() && value.empty()) s = Bad(arg, value, "empty");
      f.grpc_host = o.listen_host = std::string(value);
    } else if (arg == "--port") {
      s = int_flag(0, 65535, &f.grpc_port);
    } else if (arg == "--model") {
      if (s = take(); s.ok()) o.model = std::string(value);
    } else if (arg == "--seed") {
      if (s = take(); s.ok() && !ParseInt<uint64_t>(value, 0, UINT64_MAX, &o.seed)) {
        s = Bad(arg, value, "not an unsigned integer");
      }
    } else if (arg == "--tp") {
      s = int_flag(1, 64, &tp);
    } else if (arg == "--pp") {
      s = int_flag(1, 64, &pp);
    } else if (arg == "--threads") {
      s = int_flag(0, 1024, &o.threads_per_rank);
    } else if (arg == "--backend") {
      if (s = take(); s.ok()) o.backend = std::string(value);
    } else if (arg == "--backend-option") {
      if (s = take(); s.ok()) {
        const size_t eq = value.find('=');
        if (eq == std::string_view::npos || eq == 0) {
          s = Bad(arg, value, "expected KEY=VALUE");
        } else {
          o.backend_options[std::string(value.substr(0, eq))] = std::string(value.substr(eq + 1));
        }
      }
    } else if (arg == "--bootstrap-host" && prefill) {
      if (s = take(); s.ok() && value.empty()) s = Bad(arg, value, "empty");
      o.bootstrap_host = std::string(value);
    } else if (arg == "--bootstrap-port" && prefill) {
      int32_t port = 0;
      if (s = int_flag(0, 65535, &port); s.ok()) o.bootstrap_port = static_cast<uint16_t>(port);
    } else if (arg == "--num-pages") {
      s = int_flag(1, kMax, &o.num_pages);
    } else if (arg == "--max-running") {
      s = int_flag(1, 1 << 16, &o.max_running);
    } else if (arg == "--chunked-prefill-size") {
      s = int_flag(1, kMax, &o.chunked_prefill_size);
    } else if (arg == "--max-context-len") {
      s = int_flag(1, kMax, &o.max_context_len);
    } else if (arg == "--reserved-decode-tokens" && !prefill) {
      s = int_flag(0, kMax, &o.reserved_decode_tokens);
    } else if (arg == "--bootstrap-timeout-ms") {
      s = ms_flag(1, &o.bootstrap_timeout);
    } else if (arg == "--waiting-timeout-ms") {
      s = ms_flag(1, &o.waiting_timeout);
    } else if (arg == "--transfer-timeout-ms") {
      s = ms_flag(1, &o.transfer_timeout);
    } else if (arg == "--liveness-timeout-ms") {
      s = ms_flag(1000, &o.liveness_timeout);
    } else if (arg == "--connect-timeout-ms") {
      s = ms_flag(1, &o.connect_timeout);
    } else if (arg == "--idle-poll-us") {
      int32_t us = 0;
      if (s = int_flag(0, 1000000, &us); s.ok()) o.idle_poll = std::chrono::microseconds(us);
    } else if (!prefill && arg == "--connect") {
      int32_t port = 0;
      if (s = take(); !s.ok()) {
      } else if (const size_t colon = value.rfind(':');
                 colon == std::string_view::npos || colon == 0 ||
                 !ParseInt<int32_t>(value.substr(colon + 1), 1, 65535, &port)) {
        s = Status::InvalidArgument("--connect wants HOST:PORT, got '" + std::string(value) + "'");
      } else {
        o.connect.emplace_back(value);
      }
    } else if (!prefill && (arg == "--bootstrap-host" || arg == "--bootstrap-port")) {
      s = Status::InvalidArgument(std::string(arg) +
                                  ": decode takes the prefill bootstrap address from each "
                                  "request (HostGenerateRequest.bootstrap_host/port)");
    } else {
      s = Status::InvalidArgument("unknown argument '" + std::string(args[i]) + "' (see --help)");
    }
    if (!s.ok()) return s;
  }
  if (f.help) return f;
  if (colocated) o.role = Role::kColocated;
  if (!prefill && (tp != 1 || pp != 1)) {
    return Status::InvalidArgument(
        "--tp " + std::to_string(tp) + " --pp " + std::to_string(pp) +
        ": pd-decode runs TP 1 and PP 1 only. The example model is not sharded, so one decode "
        "rank holds every KV head and layer and pdlib writes each prefill rank's heads and "
        "layers into the right slice of its pages; run more pd-decode hosts to scale decode");
  }
  o.tp_size = tp;
  o.pp_size = pp;
  if (Status s = ValidateHostOptions(o); !s.ok()) return s;
  return f;
}

}  // namespace pdlib::hosts
