#include "bench/transfer/iperf3.h"

#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/transfer/perftest.h"
#include "tools/common/child_process.h"
#include "tools/netns/netns_cluster.h"

namespace pdlib_bench {

Iperf3Result RunIperf3(const pdlib_tools::NetnsCluster* cluster, const std::string& server_host,
                       const std::string& server_ip, const std::string& client_host, int seconds) {
  using Clock = std::chrono::steady_clock;
  Iperf3Result r;
  if (!OnPath("iperf3")) {
    r.why = "iperf3 is not on PATH (Debian: apt-get install iperf3)";
    return r;
  }
  const uint16_t port = pdlib_tools::UnusedLocalPort();
  pdlib_tools::ChildOptions server{
      .program = "iperf3",
      .args = {"-s", "-1", "--forceflush", "-B", server_ip, "-p", std::to_string(port)},
      .stderr_mode = pdlib_tools::ChildOptions::Stderr::kMerge};
  if (cluster != nullptr) {
    auto in_host = cluster->InHost(server_host, server);
    if (!in_host.ok()) {
      r.why = in_host.status().ToString();
      return r;
    }
    server = std::move(*in_host);
  }
  pdlib_tools::ChildProcess s(std::move(server));
  if (!s.started()) {
    r.why = "cannot start iperf3 -s: " + s.error();
    return r;
  }
  // It says when it listens (a probe connection would use up its one test: -1).
  if (!s.Expect("Server listening", Clock::now() + std::chrono::seconds(10))) {
    r.why = "iperf3 -s did not say it listens on " + server_ip + ":" + std::to_string(port);
    return r;
  }
  const std::vector<std::string> client = {
      "iperf3", "-c", server_ip, "-p", std::to_string(port), "-t", std::to_string(seconds), "-J"};
  const auto timeout = std::chrono::milliseconds((seconds + 20) * 1000);
  auto ran = cluster != nullptr ? cluster->Exec(client_host, client, timeout)
                                : pdlib_tools::RunCommand(client, timeout);
  if (!ran.ok()) {
    r.why = "iperf3 -c: " + ran.status().ToString();
    return r;
  }
  if (ran->exit_status != 0) {
    r.why =
        "iperf3 -c exited " + std::to_string(ran->exit_status) + ": " + ran->output.substr(0, 300);
    return r;
  }
  const auto j = nlohmann::json::parse(ran->output, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json* bps = nullptr;
  if (j.is_object() && j.contains("end") && j["end"].contains("sum_received")) {
    bps = &j["end"]["sum_received"]["bits_per_second"];
  }
  if (bps == nullptr || !bps->is_number()) {
    r.why = "iperf3 -c -J printed no end.sum_received.bits_per_second" +
            std::string(j.is_discarded() ? " (not JSON)" : "") + ": " + ran->output.substr(0, 200);
    return r;
  }
  r.gbps = bps->get<double>() / 1e9;
  return r;
}

}  // namespace pdlib_bench
