// pdlib-transfer-bench --compare-iperf3: what one TCP stream gets over the same path as pdlib's
// transfer (iperf3 from where prefill ran to where decode ran), so that pdlib's tcp figure can be
// read against the link's: with --netns the two hosts' veth link through the bridge, else
// 127.0.0.1.
#ifndef PDLIB_BENCH_TRANSFER_IPERF3_H_
#define PDLIB_BENCH_TRANSFER_IPERF3_H_

#include <optional>
#include <string>

namespace pdlib_tools {
class NetnsCluster;
}

namespace pdlib_bench {

struct Iperf3Result {
  std::optional<double> gbps;  // received, 10^9 bits per second
  std::string why;             // why there is no figure
};

// Runs `iperf3 -s` in host `server_host` of `cluster` (or here when cluster is null) bound to
// `server_ip`, then `iperf3 -c server_ip -t seconds -J` in `client_host`; bounded to seconds + 20.
Iperf3Result RunIperf3(const pdlib_tools::NetnsCluster* cluster, const std::string& server_host,
                       const std::string& server_ip, const std::string& client_host, int seconds);

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_IPERF3_H_
