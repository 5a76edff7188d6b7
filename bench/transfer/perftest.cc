#include "bench/transfer/perftest.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "tools/common/child_process.h"

namespace pdlib_bench {

using pdlib_tools::ChildProcess;
using pdlib_tools::UnusedLocalPort;
namespace {

using Clock = std::chrono::steady_clock;

// The overall bandwidth (MB/s, UCX's MB being 2^20 bytes) of ucx_perftest -v's last CSV row:
// iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
std::optional<double> ParseOverallBandwidth(const std::string& line) {
  if (line.empty() || line[0] < '0' || line[0] > '9') return std::nullopt;
  std::vector<std::string> fields;
  std::istringstream in(line);
  for (std::string f; std::getline(in, f, ',');) fields.push_back(f);
  if (fields.size() != 8) return std::nullopt;
  char* end = nullptr;
  const double mb = std::strtod(fields[5].c_str(), &end);
  if (end == fields[5].c_str() || mb <= 0) return std::nullopt;
  return mb;
}

// Whether a TCP socket of this host listens on `port` (/proc/net/tcp and tcp6: "sl local_address
// rem_address st ...", the address as HEX:HEXPORT, state 0A = LISTEN). ucx_perftest's own "Waiting
// for connection" line sits in its stdout buffer when stdout is a pipe.
bool Listening(uint16_t port) {
  char want[8];
  std::snprintf(want, sizeof(want), ":%04X", unsigned(port));
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string sl, local, remote, state;
      fields >> sl >> local >> remote >> state;
      if (state == "0A" && local.ends_with(want)) return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::string> PerftestEnvironment(const std::map<std::string, std::string>& options) {
  std::vector<std::string> env;
  for (const auto& [key, value] : options) {
    if (key == "ucx.tls") {
      env.push_back("UCX_TLS=" + value);
    } else if (key == "ucx.net_devices") {
      env.push_back("UCX_NET_DEVICES=" + value);
    } else if (key.starts_with("ucx.config.")) {
      std::string name = key.substr(11);
      if (name.starts_with("UCX_")) name = name.substr(4);
      env.push_back("UCX_" + name + "=" + value);
    }
  }
  return env;
}

bool OnPath(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::istringstream dirs(path);
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) dir = ".";
    if (::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  }
  return false;
}

PerftestResult RunUcxPerftest(uint64_t message_bytes, uint64_t iterations,
                              const std::vector<std::string>& env) {
  const uint16_t port = UnusedLocalPort();
  if (port == 0) return {std::nullopt, "no free local port"};
  const std::vector<std::string> args = {"-t", "ucp_put_bw",
                                         "-s", std::to_string(message_bytes),
                                         "-n", std::to_string(iterations),
                                         "-p", std::to_string(port),
                                         "-v"};
  ChildProcess server({.program = "ucx_perftest",
                       .args = args,
                       .env = env,
                       .stderr_mode = pdlib_tools::ChildOptions::Stderr::kMerge});
  if (!server.started()) return {std::nullopt, "cannot start ucx_perftest"};
  const auto listen_deadline = Clock::now() + std::chrono::seconds(10);
  while (!Listening(port)) {
    if (Clock::now() > listen_deadline || server.Wait(Clock::now()) != -1) {
      return {std::nullopt,
              "the ucx_perftest server did not start listening on port " + std::to_string(port)};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::vector<std::string> client_args = {"127.0.0.1"};
  client_args.insert(client_args.end(), args.begin(), args.end());
  ChildProcess client({.program = "ucx_perftest",
                       .args = client_args,
                       .env = env,
                       .stderr_mode = pdlib_tools::ChildOptions::Stderr::kMerge});
  if (!client.started()) return {std::nullopt, "cannot start the ucx_perftest client"};
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  std::optional<double> mb;
  std::string last;
  while (auto line = client.Expect("", deadline)) {
    if (auto bw = ParseOverallBandwidth(*line)) mb = bw;
    if (!line->empty()) last = *line;
  }
  const int code = client.Wait(Clock::now() + std::chrono::seconds(5));
  server.Wait(Clock::now() + std::chrono::seconds(5));
  if (!mb) {
    return {std::nullopt, "no bandwidth in ucx_perftest's output (exit status " +
                              std::to_string(code) + ", last line: " + last + ")"};
  }
  return {*mb * 1048576.0 / 1e9, ""};
}

}  // namespace pdlib_bench
