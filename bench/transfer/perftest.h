// pdlib-transfer-bench --compare-perftest: UCX's own put bandwidth at pdlib's message size, from
// `ucx_perftest -t ucp_put_bw` run against itself on 127.0.0.1 (a server process and a client
// process), so pdlib's figure can be read next to what UCX alone gets on the same transport.
#ifndef PDLIB_BENCH_TRANSFER_PERFTEST_H_
#define PDLIB_BENCH_TRANSFER_PERFTEST_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace pdlib_bench {

// The UCX_* environment that gives ucx_perftest the UCX settings pdlib's backend options name:
// ucx.tls -> UCX_TLS, ucx.net_devices -> UCX_NET_DEVICES, ucx.config.NAME -> UCX_NAME. Other
// settings are UCX's defaults (or the caller's UCX_* environment), not pdlib's own defaults.
std::vector<std::string> PerftestEnvironment(const std::map<std::string, std::string>& options);

struct PerftestResult {
  std::optional<double> gbytes_per_s;  // overall bandwidth, 10^9 bytes per second
  std::string why;                     // why there is no figure
};

// Runs the pair with `message_bytes` per put, `iterations` puts; bounded to about two minutes.
PerftestResult RunUcxPerftest(uint64_t message_bytes, uint64_t iterations,
                              const std::vector<std::string>& env);

// Whether `program` is an executable file in a directory of $PATH.
bool OnPath(const std::string& program);

}  // namespace pdlib_bench

#endif  // PDLIB_BENCH_TRANSFER_PERFTEST_H_
